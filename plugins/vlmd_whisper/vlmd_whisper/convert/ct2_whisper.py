"""``vlmd convert --from ct2 SRC DST``: a CTranslate2 Whisper model to a Hugging Face checkpoint.

Why convert instead of loading CT2 directly: one weight format in the loader, and transformers
can load the very same files, so it serves as the parity oracle on real weights.

Writes ``config.json``, ``model.safetensors`` (float32; int8 weights are dequantized),
``generation_config.json`` (``suppress_tokens`` / ``begin_suppress_tokens`` from CT2's
``suppress_ids`` / ``suppress_ids_begin``), ``preprocessor_config.json`` and the tokenizer:
CT2's ``tokenizer.json`` lacks the 1,501 timestamp tokens, which are taken from
``vocabulary.txt`` (line number = token id) and added as special tokens.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np

from vlmd_whisper.convert.ct2_reader import CT2Model, dequantized, read_ct2_model
from vlmd_whisper.convert.whisper_tokens import whisper_special_ids, write_tokenizer

_GELU = 3  # CTranslate2's ActivationType.GELU
_COMMON = {  # per-layer CT2 path -> transformers path, for encoder and decoder layers
    "self_attention/linear_1": "self_attn.out_proj",
    "self_attention/layer_norm": "self_attn_layer_norm",
    "ffn/layer_norm": "final_layer_norm",
    "ffn/linear_0": "fc1",
    "ffn/linear_1": "fc2",
}
_DECODER_ONLY = {
    "attention/linear_0": "encoder_attn.q_proj",
    "attention/linear_2": "encoder_attn.out_proj",
    "attention/layer_norm": "encoder_attn_layer_norm",
}


def convert_ct2_whisper(source: str | Path, target: str | Path) -> Path:
    source, target = Path(source), Path(target)
    for name in ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt"):
        if not (source / name).is_file():
            raise FileNotFoundError(f"{source} has no {name}: not a CTranslate2 Whisper model directory")
    model = read_ct2_model(source / "model.bin")
    if model.spec_name != "WhisperSpec":
        raise ValueError(f"{source} holds a {model.spec_name}, not a WhisperSpec")
    _check_architecture(model)
    ct2_config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    vocabulary = (source / "vocabulary.txt").read_text(encoding="utf-8").split("\n")
    if vocabulary and vocabulary[-1] == "":
        vocabulary.pop()

    tensors = hf_state_dict(model)
    shapes = _Shapes(model, tensors)
    if len(vocabulary) != shapes.vocab_size:
        raise ValueError(f"vocabulary.txt has {len(vocabulary)} tokens, the model {shapes.vocab_size}")
    ids = whisper_special_ids(vocabulary)

    target.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "model.safetensors").chmod(0o644)  # save_file writes 0600 through a temp file
    _write_json(target / "config.json", _hf_config(shapes, ids, ct2_config))
    _write_json(target / "generation_config.json", _generation_config(shapes, ids, ct2_config))
    _write_json(target / "preprocessor_config.json", _feature_extractor_config(shapes.num_mel_bins))
    write_tokenizer(source / "tokenizer.json", vocabulary, target)
    for extra in ("README.md", "LICENSE"):
        if (source / extra).is_file():
            shutil.copy(source / extra, target / extra)
    return target


def _check_architecture(model: CT2Model) -> None:
    """Refuse variants our decoder (and transformers' Whisper) would silently compute wrong."""
    expected = {"decoder/activation": _GELU, "decoder/pre_norm": 1, "decoder/scale_embeddings": 0, "decoder/alibi": 0}
    for name, value in expected.items():
        if name in model.variables and model.scalar(name) != value:
            raise ValueError(f"unsupported Whisper variant: {name} = {model.scalar(name)}, expected {value}")


def _linear(model: CT2Model, out: dict, ct2: str, hf: str) -> None:
    out[f"{hf}.weight"] = dequantized(model, f"{ct2}/weight")
    out[f"{hf}.bias"] = model.get(f"{ct2}/bias").astype(np.float32)


def _norm(model: CT2Model, out: dict, ct2: str, hf: str) -> None:
    out[f"{hf}.weight"] = model.get(f"{ct2}/gamma").astype(np.float32)
    out[f"{hf}.bias"] = model.get(f"{ct2}/beta").astype(np.float32)


def _split_rows(array: np.ndarray, parts: int) -> list[np.ndarray]:
    return [np.ascontiguousarray(part) for part in np.split(array, parts, axis=0)]


def _layer(model: CT2Model, out: dict, ct2: str, hf: str, decoder: bool) -> None:
    for ct2_part, hf_part in {**_COMMON, **(_DECODER_ONLY if decoder else {})}.items():
        if ct2_part.endswith("layer_norm"):
            _norm(model, out, f"{ct2}/{ct2_part}", f"{hf}.{hf_part}")
        else:
            _linear(model, out, f"{ct2}/{ct2_part}", f"{hf}.{hf_part}")
    # Self-attention Q, K, V are stacked in one linear; transformers' k_proj has no bias and
    # CT2 keeps a zero slot for it.
    q_w, k_w, v_w = _split_rows(dequantized(model, f"{ct2}/self_attention/linear_0/weight"), 3)
    q_b, k_b, v_b = _split_rows(model.get(f"{ct2}/self_attention/linear_0/bias").astype(np.float32), 3)
    if np.any(k_b):
        raise ValueError(f"{ct2}: the key projection has a bias; Whisper's has none")
    out.update({f"{hf}.self_attn.q_proj.weight": q_w, f"{hf}.self_attn.q_proj.bias": q_b,
                f"{hf}.self_attn.k_proj.weight": k_w,
                f"{hf}.self_attn.v_proj.weight": v_w, f"{hf}.self_attn.v_proj.bias": v_b})
    if decoder:  # cross-attention K and V are stacked too
        k_w, v_w = _split_rows(dequantized(model, f"{ct2}/attention/linear_1/weight"), 2)
        k_b, v_b = _split_rows(model.get(f"{ct2}/attention/linear_1/bias").astype(np.float32), 2)
        if np.any(k_b):
            raise ValueError(f"{ct2}: the cross-attention key projection has a bias; Whisper's has none")
        out.update({f"{hf}.encoder_attn.k_proj.weight": k_w,
                    f"{hf}.encoder_attn.v_proj.weight": v_w, f"{hf}.encoder_attn.v_proj.bias": v_b})


def hf_state_dict(model: CT2Model) -> dict[str, np.ndarray]:
    """transformers' ``WhisperForConditionalGeneration`` names, float32 (proj_out stays tied)."""
    out: dict[str, np.ndarray] = {}
    for conv in ("conv1", "conv2"):
        out[f"model.encoder.{conv}.weight"] = dequantized(model, f"encoder/{conv}/weight")
        out[f"model.encoder.{conv}.bias"] = model.get(f"encoder/{conv}/bias").astype(np.float32)
    out["model.encoder.embed_positions.weight"] = model.get("encoder/position_encodings/encodings").astype(np.float32)
    out["model.decoder.embed_positions.weight"] = model.get("decoder/position_encodings/encodings").astype(np.float32)
    out["model.decoder.embed_tokens.weight"] = dequantized(model, "decoder/embeddings/weight")
    for side in ("encoder", "decoder"):
        _norm(model, out, f"{side}/layer_norm", f"model.{side}.layer_norm")
        for index in range(_num_layers(model, side)):
            _layer(model, out, f"{side}/layer_{index}", f"model.{side}.layers.{index}", decoder=side == "decoder")
    projection = model.get("decoder/projection/weight")
    if projection is not model.get("decoder/embeddings/weight"):
        raise ValueError("the output projection is not tied to the token embeddings; Whisper's is")
    return out


def _num_layers(model: CT2Model, side: str) -> int:
    pattern = re.compile(rf"^{side}/layer_(\d+)/")
    indices = {int(match.group(1)) for match in map(pattern.match, model.variables) if match}
    if indices != set(range(len(indices))):
        raise ValueError(f"{side} layers are not numbered 0..n-1: {sorted(indices)}")
    return len(indices)


class _Shapes:
    def __init__(self, model: CT2Model, tensors: dict[str, np.ndarray]):
        self.vocab_size, self.d_model = tensors["model.decoder.embed_tokens.weight"].shape
        self.num_mel_bins = tensors["model.encoder.conv1.weight"].shape[1]
        self.encoder_layers = _num_layers(model, "encoder")
        self.decoder_layers = _num_layers(model, "decoder")
        self.encoder_heads = model.scalar("encoder/num_heads")
        self.decoder_heads = model.scalar("decoder/num_heads")
        self.encoder_ffn = tensors["model.encoder.layers.0.fc1.weight"].shape[0]
        self.decoder_ffn = tensors["model.decoder.layers.0.fc1.weight"].shape[0]
        self.max_source_positions = tensors["model.encoder.embed_positions.weight"].shape[0]
        self.max_target_positions = tensors["model.decoder.embed_positions.weight"].shape[0]


def _hf_config(shapes: _Shapes, ids: dict, ct2_config: dict) -> dict:
    from transformers import WhisperConfig

    config = WhisperConfig(
        vocab_size=shapes.vocab_size, num_mel_bins=shapes.num_mel_bins, d_model=shapes.d_model,
        encoder_layers=shapes.encoder_layers, decoder_layers=shapes.decoder_layers,
        encoder_attention_heads=shapes.encoder_heads, decoder_attention_heads=shapes.decoder_heads,
        encoder_ffn_dim=shapes.encoder_ffn, decoder_ffn_dim=shapes.decoder_ffn, activation_function="gelu",
        max_source_positions=shapes.max_source_positions, max_target_positions=shapes.max_target_positions,
        pad_token_id=ids["eos"], bos_token_id=ids["eos"], eos_token_id=ids["eos"],
        decoder_start_token_id=ids["sot"], suppress_tokens=list(ct2_config.get("suppress_ids", [])),
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin", [])),
        scale_embedding=False, tie_word_embeddings=True,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    return config.to_dict()


def _generation_config(shapes: _Shapes, ids: dict, ct2_config: dict) -> dict:
    config = {
        "decoder_start_token_id": ids["sot"],
        "bos_token_id": ids["sot"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["eos"],
        "is_multilingual": ids["multilingual"],
        "no_timestamps_token_id": ids["no_timestamps"],
        "prev_sot_token_id": ids["prev_sot"],
        "max_initial_timestamp_index": 50,  # OpenAI's max_initial_timestamp = 1.0 s
        "suppress_tokens": list(ct2_config.get("suppress_ids", [])),
        "begin_suppress_tokens": list(ct2_config.get("suppress_ids_begin", [])),
        "max_length": shapes.max_target_positions,
    }
    if ct2_config.get("alignment_heads"):
        config["alignment_heads"] = [list(pair) for pair in ct2_config["alignment_heads"]]
    if ids["multilingual"]:
        # English-only models must not have these: transformers would then accept a language.
        config["lang_to_id"] = ids["lang_to_id"]
        config["task_to_id"] = {"transcribe": ids["transcribe"], "translate": ids["translate"]}
    return config


def _feature_extractor_config(num_mel_bins: int) -> dict:
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "WhisperProcessor",
        "feature_size": int(num_mel_bins),
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 30,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
    }


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
