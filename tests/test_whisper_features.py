"""Log-mel features (plugins/vlmd_whisper/features.py) against transformers' WhisperFeatureExtractor.

Tolerance: the numpy path of transformers (``_np_extract_fbank_features``) computes the same
float64 arithmetic, so we match it to float32 rounding (max abs difference <= 1e-6). The
extractor's default path (torch.stft in float32) differs by float32 STFT error: we allow
1e-4 (measured: up to 5e-5 on speech and pure tones) on features that span about [-1.5, 1.5].
"""

from __future__ import annotations

import numpy as np
import pytest

from vlmd_whisper.features import FeatureSettings, log_mel_features, mel_filter_bank
from whisper_support import FOX, needs_espeak, read_samples, speech_wav


def _signals() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    t = np.arange(16000 * 10) / 16000
    return {
        "noise 31 s (cut to 30 s)": (rng.standard_normal(16000 * 31) * 0.3).astype(np.float32),
        "chirp 10 s": (0.8 * np.sin(2 * np.pi * (100 + 300 * t) * t)).astype(np.float32),
        "short click": np.concatenate([np.ones(10, np.float32), np.zeros(90, np.float32)]),
        "silence": np.zeros(1600, np.float32),
        "one sample": np.array([0.5], np.float32),
    }


@pytest.fixture(scope="module")
def extractor():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400)


def test_mel_filters_equal_transformers():
    from transformers.audio_utils import mel_filter_bank as hf_mel_filter_bank

    for bins in (80, 128):
        ours = mel_filter_bank(201, bins, 16000)
        theirs = hf_mel_filter_bank(201, bins, 0.0, 8000.0, 16000, norm="slaney", mel_scale="slaney")
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", list(_signals()))
def test_features_match_transformers(extractor, name):
    samples = _signals()[name]
    ours = log_mel_features(samples)
    assert ours.shape == (80, 3000) and ours.dtype == np.float32
    default = extractor(samples, sampling_rate=16000, return_tensors="np").input_features[0]
    np.testing.assert_allclose(ours, default, atol=1e-4, rtol=0)
    window = np.zeros(480000, np.float32)
    window[: min(samples.shape[0], 480000)] = samples[:480000]
    numpy_path = extractor._np_extract_fbank_features(window[None], "cpu")[0]
    np.testing.assert_allclose(ours, numpy_path, atol=1e-6, rtol=0)


@needs_espeak
def test_features_match_transformers_on_speech(extractor):
    samples = read_samples(speech_wav(FOX))
    ours = log_mel_features(samples)
    np.testing.assert_allclose(ours, extractor(samples, sampling_rate=16000).input_features[0], atol=1e-4, rtol=0)


def test_settings_come_from_the_preprocessor_config():
    settings = FeatureSettings.from_preprocessor_config({"feature_size": 128, "chunk_length": 30})
    assert (settings.num_mel_bins, settings.num_frames, settings.window_samples) == (128, 3000, 480000)
    assert log_mel_features(np.zeros(10, np.float32), settings).shape == (128, 3000)
    with pytest.raises(ValueError, match="mono"):
        log_mel_features(np.zeros((10, 2), np.float32))
