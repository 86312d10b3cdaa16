"""Whisper's log-mel features in numpy, equal to transformers' ``WhisperFeatureExtractor``.

Per 30 s window: pad (or cut) the 16 kHz signal to ``chunk_length * sampling_rate``
samples with zeros, take a centred STFT (periodic Hann window of ``n_fft``, reflect padding,
hop ``hop_length``), the power spectrum through a Slaney-scale, Slaney-normalised mel filter
bank, ``log10`` floored at 1e-10, the last frame dropped, values clamped to 8 below the
window's maximum and mapped with ``(x + 4) / 4``. Computed in float64, returned as float32;
``tests/test_whisper_features.py`` states the tolerance against transformers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FeatureSettings:
    num_mel_bins: int = 80
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400

    def __post_init__(self) -> None:
        for name in ("num_mel_bins", "sampling_rate", "hop_length", "chunk_length", "n_fft"):
            if getattr(self, name) < 1:
                raise ValueError(f"feature setting {name} must be positive")

    @property
    def window_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def num_frames(self) -> int:
        return self.window_samples // self.hop_length

    @classmethod
    def from_preprocessor_config(cls, config: dict) -> "FeatureSettings":
        return cls(
            num_mel_bins=int(config.get("feature_size", 80)),
            sampling_rate=int(config.get("sampling_rate", 16000)),
            hop_length=int(config.get("hop_length", 160)),
            chunk_length=int(config.get("chunk_length", 30)),
            n_fft=int(config.get("n_fft", 400)),
        )


def _hertz_to_mel(hertz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    hertz = np.asarray(hertz, dtype=np.float64)
    mels = 3.0 * hertz / 200.0
    log_region = hertz >= 1000.0
    logstep = 27.0 / np.log(6.4)
    return np.where(log_region, 15.0 + np.log(np.maximum(hertz, 1e-10) / 1000.0) * logstep, mels)


def _mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    hertz = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    logstep = np.log(6.4) / 27.0
    return np.where(log_region, 1000.0 * np.exp(logstep * (mels - 15.0)), hertz)


@functools.lru_cache(maxsize=8)
def mel_filter_bank(num_frequency_bins: int, num_mel_filters: int, sampling_rate: int,
                    min_frequency: float = 0.0, max_frequency: float = 8000.0) -> np.ndarray:
    """Triangular filters ``[num_frequency_bins, num_mel_filters]``, each scaled to unit area
    in Hz (Slaney normalisation), like librosa and transformers."""
    mel_points = np.linspace(_hertz_to_mel(min_frequency), _hertz_to_mel(max_frequency), num_mel_filters + 2)
    filter_hertz = _mel_to_hertz(mel_points)
    fft_hertz = np.linspace(0, sampling_rate // 2, num_frequency_bins)
    widths = np.diff(filter_hertz)
    slopes = filter_hertz[np.newaxis, :] - fft_hertz[:, np.newaxis]  # [freq, mel + 2]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    filters *= 2.0 / (filter_hertz[2:] - filter_hertz[:-2])
    filters.setflags(write=False)
    return filters


@functools.lru_cache(maxsize=4)
def _periodic_hann(length: int) -> np.ndarray:
    window = np.hanning(length + 1)[:-1]
    window.setflags(write=False)
    return window


def log_mel_features(samples: np.ndarray, settings: FeatureSettings = FeatureSettings()) -> np.ndarray:
    """float32 ``[num_mel_bins, num_frames]`` for one window of 16 kHz mono samples."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 1:
        raise ValueError(f"expected mono samples, got shape {samples.shape}")
    window = np.zeros(settings.window_samples, dtype=np.float64)
    count = min(samples.shape[0], settings.window_samples)
    window[:count] = samples[:count]
    half = settings.n_fft // 2
    padded = np.pad(window, half, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, settings.n_fft)[:: settings.hop_length]
    spectrum = np.fft.rfft(frames * _periodic_hann(settings.n_fft), axis=-1)
    power = spectrum.real**2 + spectrum.imag**2  # [frames, n_fft // 2 + 1]
    filters = mel_filter_bank(settings.n_fft // 2 + 1, settings.num_mel_bins, settings.sampling_rate)
    mel = (power @ filters).T[:, :-1]  # the last frame is dropped, as in Whisper
    log_mel = np.log10(np.maximum(mel, 1e-10))
    log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
    return ((log_mel + 4.0) / 4.0).astype(np.float32)
