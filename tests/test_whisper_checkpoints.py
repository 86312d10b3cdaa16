"""Whisper checkpoints: the tiny random builder and ``vlmd convert --from ct2`` (real tiny.en)."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from whisper_support import needs_tiny_en


def _digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_tiny_whisper_is_deterministic(tiny_whisper_dir, tmp_path):
    from vlmd.testing.tiny import build_tiny

    again = build_tiny("whisper", tmp_path / "again", seed=0, size="tiny")
    assert _digest(again) == _digest(tiny_whisper_dir)
    other = build_tiny("whisper", tmp_path / "other", seed=1, size="tiny")
    assert _digest(other)["model.safetensors"] != _digest(tiny_whisper_dir)["model.safetensors"]


def test_tiny_whisper_loads_in_transformers_offline(tiny_whisper_dir):
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(tiny_whisper_dir, dtype=torch.float32)
    processor = WhisperProcessor.from_pretrained(tiny_whisper_dir)
    tokenizer = processor.tokenizer
    assert type(tokenizer).__name__ == "WhisperTokenizer"
    assert len(tokenizer) == model.config.vocab_size
    summary = json.loads((tiny_whisper_dir / "vlmd_tiny.json").read_text())
    # transformers computes language tokens as <|startoftranscript|> + 1 + index in its table.
    assert tokenizer.convert_tokens_to_ids("<|fr|>") == model.generation_config.lang_to_id["<|fr|>"]
    assert tokenizer.convert_tokens_to_ids("<|0.00|>") == summary["timestamp_begin"]
    assert tokenizer.convert_tokens_to_ids("<|30.00|>") == model.config.vocab_size - 1
    assert model.generation_config.no_timestamps_token_id + 1 == summary["timestamp_begin"]
    features = processor(np.zeros(16000, np.float32), sampling_rate=16000, return_tensors="pt").input_features
    assert features.shape == (1, 80, 3000)
    # Multilingual: generate detects the language, translates, predicts timestamps.
    for kwargs in ({}, {"task": "translate"}, {"language": "en", "return_timestamps": True}):
        model.generate(features, max_new_tokens=4, **kwargs)


def test_builder_cli_writes_a_whisper_checkpoint(tmp_path):
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "vlmd.testing.tiny", "--family", "whisper", "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert "built whisper" in result.stdout
    assert json.loads((out / "config.json").read_text())["architectures"] == ["WhisperForConditionalGeneration"]


# ---- CTranslate2 reader ---------------------------------------------------------------


def _ct2_string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def _ct2_variable(name: str, array: np.ndarray, dtype_id: int) -> bytes:
    header = _ct2_string(name) + struct.pack("<B", array.ndim) + struct.pack(f"<{array.ndim}I", *array.shape)
    data = array.tobytes()
    return header + struct.pack("<BI", dtype_id, len(data)) + data


def test_ct2_reader_dequantizes_int8_and_follows_aliases(tmp_path):
    from vlmd_whisper.convert.ct2_reader import dequantized, read_ct2_model

    weight = np.array([[0.5, -1.0, 0.25], [2.0, 1.0, -0.5]], dtype=np.float32)
    scale = (127.0 / np.abs(weight).max(axis=1)).astype(np.float32)
    quantized = np.round(weight * scale[:, None]).astype(np.int8)
    bf16 = (np.array([1.5, -2.0], dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    variables = [
        _ct2_variable("a/bf16", bf16, 5),
        _ct2_variable("a/linear/weight", quantized, 1),
        _ct2_variable("a/linear/weight_scale", scale, 0),
        _ct2_variable("a/num_heads", np.array(6, dtype=np.int16), 2),
    ]
    blob = struct.pack("<I", 6) + _ct2_string("TestSpec") + struct.pack("<I", 1)
    blob += struct.pack("<I", len(variables)) + b"".join(variables)
    blob += struct.pack("<I", 1) + _ct2_string("a/tied/weight") + _ct2_string("a/linear/weight")
    (tmp_path / "model.bin").write_bytes(blob)

    model = read_ct2_model(tmp_path / "model.bin")
    assert model.spec_name == "TestSpec" and model.scalar("a/num_heads") == 6
    np.testing.assert_allclose(dequantized(model, "a/linear/weight"), weight, atol=1 / 127)
    assert model.get("a/tied/weight") is model.get("a/linear/weight")
    np.testing.assert_array_equal(model.get("a/bf16"), [1.5, -2.0])

    (tmp_path / "bad.bin").write_bytes(blob[:40])
    with pytest.raises(ValueError, match="truncated"):
        read_ct2_model(tmp_path / "bad.bin")


def test_convert_refuses_a_directory_that_is_not_ct2_whisper(tmp_path):
    result = subprocess.run([sys.executable, "-m", "vlmd", "convert", "--from", "ct2", str(tmp_path), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "not a CTranslate2 Whisper model directory" in result.stderr


# ---- the real tiny.en ------------------------------------------------------------------


@needs_tiny_en
def test_converted_tiny_en_loads_in_transformers_with_every_weight(tiny_en_dir):
    import torch
    from safetensors import safe_open
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model, info = WhisperForConditionalGeneration.from_pretrained(
        tiny_en_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with safe_open(str(tiny_en_dir / "model.safetensors"), framework="pt") as handle:
        assert {handle.get_slice(name).get_dtype() for name in handle.keys()} == {"F32"}
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
    config = model.config
    assert (config.d_model, config.encoder_layers, config.decoder_layers, config.vocab_size) == (384, 4, 4, 51864)
    generation = model.generation_config
    assert generation.is_multilingual is False and not hasattr(generation, "lang_to_id")
    assert (generation.decoder_start_token_id, generation.eos_token_id, generation.no_timestamps_token_id) == (
        50257, 50256, 50362)
    assert len(generation.suppress_tokens) == 90 and generation.begin_suppress_tokens == [220, 50256]

    tokenizer = WhisperProcessor.from_pretrained(tiny_en_dir).tokenizer
    assert len(tokenizer) == 51864
    assert tokenizer.convert_tokens_to_ids(["<|0.00|>", "<|30.00|>"]) == [50363, 51863]
    assert tokenizer.decode([50363, 383, 2068, 50400], skip_special_tokens=True) == " The quick"
    assert set(range(50256, 50363)) <= set(tokenizer.all_special_ids)
