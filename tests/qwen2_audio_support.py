"""Clips for the Qwen2-Audio tests: made with numpy, encoded with soundfile, and decoded here
independently of vlmd for the transformers reference. Not a test module."""

from __future__ import annotations

import base64
import io

import numpy as np
import soundfile as sf
import soxr

RATE = 16000


def make_clip(seconds: float, seed: int, rate: int = RATE) -> np.ndarray:
    """A gliding, pulsing tone in a little noise: different per seed, so answers differ."""
    t = np.arange(int(round(seconds * rate))) / rate
    rng = np.random.default_rng(seed)
    tone = np.sin(2 * np.pi * (180 + 90 * seed + 35 * t) * t) * (0.6 + 0.4 * np.sin(2 * np.pi * (0.7 + 0.2 * seed) * t))
    return (0.3 * tone + 0.03 * rng.standard_normal(t.shape[0])).astype(np.float32)


def encode(samples: np.ndarray, fmt: str, rate: int = RATE) -> bytes:
    buffer = io.BytesIO()
    subtype = {"WAV": "PCM_16", "FLAC": "PCM_16", "OGG": "VORBIS"}[fmt]
    sf.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def decoded(data: bytes) -> np.ndarray:
    """The samples transformers gets: decoded here with soundfile, resampled with soxr HQ."""
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    return samples if rate == RATE else soxr.resample(samples, rate, RATE, quality="HQ").astype(np.float32)


def input_audio(data: bytes, fmt: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def audio_url(url: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": url}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}
