"""vlmd/media/audio.py: formats, mono mix, resampling, and the bounds (4xx, never a crash)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from vlmd.errors import MediaError, PayloadTooLargeError
from vlmd.media.audio import decode_audio, resample
from vlmd.media.policy import MediaPolicy
from whisper_support import wav_bytes

POLICY = MediaPolicy()


def _tone(frequency: float, seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def _encoded(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    import soundfile

    buffer = io.BytesIO()
    subtype = {"WAV": "PCM_16", "FLAC": "PCM_16", "OGG": "VORBIS", "MP3": "MPEG_LAYER_III"}[fmt]
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def _dominant_frequency(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.shape[0])))
    return float(np.argmax(spectrum) * rate / samples.shape[0])


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG", "MP3"])
def test_formats_decode_to_mono_16k(fmt):
    left, right = _tone(440, 2.0, 44100, 0.6), _tone(440, 2.0, 44100, 0.2)
    decoded = decode_audio(_encoded(np.stack([left, right], axis=1), 44100, fmt), POLICY)
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    assert abs(decoded.shape[0] - 32000) < 2000  # MP3 adds encoder delay and padding
    middle = decoded[4000:28000]
    assert abs(_dominant_frequency(middle, 16000) - 440) < 2
    # The channels are averaged: amplitude (0.6 + 0.2) / 2.
    assert np.sqrt(2) * middle.std() == pytest.approx(0.4, abs=0.02)


def test_resampling_is_band_limited_and_exact_on_a_tone():
    # 22.05 kHz -> 16 kHz: a 1 kHz tone must come out as the same tone, not an aliased one.
    resampled = resample(_tone(1000, 1.0, 22050), 22050, 16000)
    expected = _tone(1000, 1.0, 16000)
    assert resampled.shape == expected.shape
    np.testing.assert_allclose(resampled[500:-500], expected[500:-500], atol=2e-3)
    # A 10 kHz tone is above the new Nyquist frequency (8 kHz): it must be filtered out.
    assert np.abs(resample(_tone(10000, 1.0, 44100), 44100, 16000)[500:-500]).max() < 1e-3


def test_16k_wav_is_read_without_resampling():
    samples = np.round(_tone(300, 1.0, 16000) * 32767) / 32767
    decoded = decode_audio(wav_bytes(samples), POLICY)
    np.testing.assert_allclose(decoded, samples, atol=1 / 32767)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (b"this is plain text, not audio" * 10, "not a supported format"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00", "cannot decode"),
        (b"\x89PNG\r\n\x1a\n" + bytes(64), "not a supported format"),
        (b"ID3" + bytes(200), "cannot decode"),
        (bytes(4) + b"ftypisom" + bytes(100), "cannot decode"),
    ],
)
def test_bad_audio_is_a_400(data, message):
    with pytest.raises(MediaError, match=message) as info:
        decode_audio(data, POLICY)
    assert info.value.status == 400


def test_audio_without_samples_is_a_400():
    with pytest.raises(MediaError, match="no samples"):
        decode_audio(wav_bytes(np.zeros(0, np.float32)), POLICY)


def test_upload_size_bound_is_a_413_with_a_25_mb_default():
    assert POLICY.max_audio_bytes == 25 * 2**20
    data = wav_bytes(np.zeros(8000, np.float32))
    with pytest.raises(PayloadTooLargeError, match="limit is 1000 bytes") as info:
        decode_audio(data, MediaPolicy(max_audio_bytes=1000))
    assert info.value.status == 413


def test_duration_bound_is_checked_from_the_header_before_decoding():
    assert POLICY.max_audio_duration_s == 600
    data = wav_bytes(np.zeros(8000 * 11, np.float32), rate=8000)
    with pytest.raises(MediaError, match="limit of 10 seconds"):
        decode_audio(data, MediaPolicy(max_audio_duration_s=10))
    assert decode_audio(data, MediaPolicy(max_audio_duration_s=12)).shape == (16000 * 11,)


def test_duration_bound_holds_when_the_header_lies():
    # A WAV header that declares a streaming (unknown) length: the bound is enforced while
    # decoding. libsndfile reads 0xFFFFFFFF data sizes as "to the end of the file".
    data = bytearray(wav_bytes(np.zeros(8000 * 11, np.float32), rate=8000))
    data[4:8] = b"\xff\xff\xff\xff"
    data[40:44] = b"\xff\xff\xff\xff"
    with pytest.raises(MediaError, match="limit of 10 seconds"):
        decode_audio(bytes(data), MediaPolicy(max_audio_duration_s=10))


def test_mp3_duration_bound():
    data = _encoded(np.zeros(16000 * 12, np.float32), 16000, "MP3")
    with pytest.raises(MediaError, match="limit of 10 seconds"):
        decode_audio(data, MediaPolicy(max_audio_duration_s=10))


def test_decoded_bytes_bound_counts_channels_at_the_source_rate():
    # 2 s of 8 channels at 48 kHz is 3 MB of float32 although it is short.
    data = wav_bytes(np.zeros((96000, 8), np.float32), rate=48000)
    with pytest.raises(MediaError, match="8 channels at 48000 Hz"):
        decode_audio(data, MediaPolicy(max_audio_decoded_bytes=2 * 2**20))
    assert decode_audio(data, MediaPolicy(max_audio_decoded_bytes=4 * 2**20)).shape == (32000,)


def test_unlisted_containers_are_refused():
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="au") as container:  # Sun AU: FFmpeg reads it, we do not accept it
        stream = container.add_stream("pcm_s16be", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            container.mux(packet)
    with pytest.raises(MediaError, match="not a supported format"):
        decode_audio(buffer.getvalue(), POLICY)


@pytest.mark.parametrize("fmt, codec", [("mp4", "aac"), ("webm", "libopus")])
def test_browser_and_phone_containers_decode(fmt, codec):
    import av

    if codec not in av.codecs_available:
        pytest.skip(f"this FFmpeg build has no {codec} encoder")
    rate = 48000
    tone = _tone(660, 1.5, rate, 0.5)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout="mono")
        step = 960
        for start in range(0, tone.shape[0], step):
            frame = av.AudioFrame.from_ndarray(tone[None, start : start + step], format="flt", layout="mono")
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    decoded = decode_audio(buffer.getvalue(), POLICY)
    assert abs(decoded.shape[0] - 24000) < 3000
    assert abs(_dominant_frequency(decoded[2000:20000], 16000) - 660) < 3
