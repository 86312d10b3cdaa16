"""Decode audio bytes into mono float32 samples at a target rate, under a MediaPolicy.

WAV, FLAC and OGG (Vorbis/Opus) go through libsndfile (soundfile); MP3 and the containers
clients upload from browsers and phones (MP4/M4A, WebM) through FFmpeg (PyAV), with the
demuxer chosen from the magic bytes. Each decoder only sees the formats listed here: the many
other formats those libraries could parse stay away from untrusted bytes. Channels are averaged (as ``ffmpeg -ac 1``, which OpenAI's
Whisper uses), then the signal is resampled with soxr's high-quality filter.

Every bound is checked from the header before decoding when the header states the length,
and again while decoding, so a file whose header lies cannot decode past them:
- ``max_audio_duration_s``: seconds of decoded audio;
- ``max_audio_decoded_bytes``: float32 samples across all channels at the source rate
  (8 channels at 192 kHz is 6 MB a second: a short file can still exhaust memory).
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np

from vlmd.errors import MediaError, PayloadTooLargeError
from vlmd.media.fetch import fetch_bytes
from vlmd.media.policy import MediaPolicy

SOUNDFILE_FORMATS = ("WAV", "WAVEX", "FLAC", "OGG")
SUPPORTED = "wav, flac, ogg, mp3, m4a/mp4, webm"
_MAX_SOURCE_RATE = 768_000
_BLOCK_FRAMES = 65536


def load_audio(url: str, policy: MediaPolicy, target_rate: int = 16000) -> np.ndarray:
    """Fetch ``url`` (data:, http(s)://, file://) and decode it; blocking, run off the loop."""
    data = fetch_bytes(url, dataclasses.replace(policy, max_bytes=policy.max_audio_bytes))
    return decode_audio(data, policy, target_rate)


def decode_audio(data: bytes, policy: MediaPolicy, target_rate: int = 16000) -> np.ndarray:
    """``data`` as mono float32 samples at ``target_rate``, or raise a 4xx error."""
    if not data:
        raise MediaError("audio data is empty")
    if len(data) > policy.max_audio_bytes:
        raise PayloadTooLargeError(
            f"audio file is {len(data)} bytes; the limit is {policy.max_audio_bytes} bytes"
        )
    decoded = _decode_with_soundfile(data, policy)
    if decoded is None:
        decoded = _decode_with_pyav(data, policy)
    samples, rate = decoded
    if samples.shape[0] == 0:
        raise MediaError("audio has no samples")
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    return resample(mono, rate, target_rate)


def resample(samples: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """Band-limited resampling (soxr HQ); a no-op at the same rate."""
    if source_rate == target_rate:
        return np.ascontiguousarray(samples, dtype=np.float32)
    import soxr

    return soxr.resample(samples.astype(np.float32, copy=False), source_rate, target_rate, quality="HQ")


class _Budget:
    """Running checks against the policy while frames arrive."""

    def __init__(self, policy: MediaPolicy, rate: int, channels: int):
        if not 0 < rate <= _MAX_SOURCE_RATE:
            raise MediaError(f"audio sample rate {rate} Hz is not supported")
        if not 0 < channels <= 64:
            raise MediaError(f"audio with {channels} channels is not supported")
        self.policy, self.rate, self.channels = policy, rate, channels
        self.frames = 0

    def check(self, frames: int) -> None:
        seconds = frames / self.rate
        if seconds > self.policy.max_audio_duration_s:
            raise MediaError(
                f"audio is longer than the limit of {self.policy.max_audio_duration_s:g} seconds"
                f" ({seconds:.1f} s or more)"
            )
        decoded_bytes = frames * self.channels * 4
        if decoded_bytes > self.policy.max_audio_decoded_bytes:
            raise MediaError(
                f"decoded audio would take {decoded_bytes} bytes ({self.channels} channels at "
                f"{self.rate} Hz); the limit is {self.policy.max_audio_decoded_bytes} bytes"
            )

    def add(self, frames: int) -> None:
        self.frames += frames
        self.check(self.frames)


def _decode_with_soundfile(data: bytes, policy: MediaPolicy) -> tuple[np.ndarray, int] | None:
    """(frames x channels, rate), or None when libsndfile is not the decoder for ``data``."""
    import soundfile

    try:
        handle = soundfile.SoundFile(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError):
        return None
    with handle:
        if handle.format not in SOUNDFILE_FORMATS:
            return None  # e.g. MP3: PyAV's job
        budget = _Budget(policy, handle.samplerate, handle.channels)
        if handle.frames > 0:
            budget.check(handle.frames)  # the header's length, before decoding anything
        blocks = []
        try:
            while True:
                block = handle.read(_BLOCK_FRAMES, dtype="float32", always_2d=True)
                if block.shape[0] == 0:
                    break
                budget.add(block.shape[0])
                blocks.append(block)
        except (soundfile.LibsndfileError, RuntimeError) as exc:
            raise MediaError(f"cannot decode {handle.format} audio: {_reason(exc)}") from None
    if not blocks:
        return np.zeros((0, 1), dtype=np.float32), handle.samplerate
    return np.concatenate(blocks), budget.rate


def container_format(data: bytes) -> str | None:
    """The FFmpeg demuxer for ``data`` judged by its magic bytes, or None.

    Naming the demuxer keeps FFmpeg from probing every format it knows on untrusted bytes.
    """
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    if data[4:8] == b"ftyp":
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    return None


def _decode_with_pyav(data: bytes, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    import av

    demuxer = container_format(data)
    if demuxer is None:
        raise MediaError(f"cannot decode the audio data: not a supported format ({SUPPORTED})")
    try:
        container = av.open(io.BytesIO(data), mode="r", format=demuxer)
    except (av.FFmpegError, ValueError, OSError):
        raise MediaError(f"cannot decode the audio data as {demuxer}; supported formats: {SUPPORTED}") from None
    with container:
        if not container.streams.audio:
            raise MediaError("the file has no audio stream")
        stream = container.streams.audio[0]
        budget = _Budget(policy, stream.codec_context.sample_rate or stream.rate or 0, stream.codec_context.channels)
        if container.duration:  # microseconds, from the header
            budget.check(int(container.duration * budget.rate / 1_000_000))
        chunks = []
        try:
            for frame in container.decode(stream):
                if frame.sample_rate != budget.rate or len(frame.layout.channels) != budget.channels:
                    raise MediaError("audio changes sample rate or channel count mid-stream; not supported")
                chunk = _frame_samples(frame)
                budget.add(chunk.shape[0])
                chunks.append(chunk)
        except av.FFmpegError as exc:
            raise MediaError(f"cannot decode {container.format.name} audio: {_reason(exc)}") from None
    if not chunks:
        return np.zeros((0, 1), dtype=np.float32), budget.rate
    return np.concatenate(chunks), budget.rate


def _frame_samples(frame) -> np.ndarray:
    """One decoded PyAV frame as float32 [samples, channels] in [-1, 1]."""
    array = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if frame.format.is_planar:
        array = array.reshape(channels, -1).T
    else:
        array = array.reshape(-1, channels)
    if np.issubdtype(array.dtype, np.unsignedinteger):  # u8 PCM: silence is 128
        half = float(np.iinfo(array.dtype).max + 1) / 2
        return ((array.astype(np.float32) - half) / half).astype(np.float32)
    if np.issubdtype(array.dtype, np.integer):
        scale = float(np.iinfo(array.dtype).max) + 1.0
        return (array.astype(np.float32) / scale).astype(np.float32)
    return array.astype(np.float32, copy=False)


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return text[:200] if text else type(exc).__name__
