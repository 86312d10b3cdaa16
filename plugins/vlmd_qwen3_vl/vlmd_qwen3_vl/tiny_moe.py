"""Deterministic random Qwen3-VL-MoE checkpoints for tests (``Qwen3VLMoeForConditionalGeneration``).

Qwen3-VL's tiny checkpoint (``tiny.py``: the same tower, tokenizer, template and processor
files) with a mixture of experts in the text model: 8 experts, 2 a token, and one dense
layer (``mlp_only_layers``) so both kinds of layer are exercised. The experts are fused 3D
tensors, stored as published checkpoints store them (transformers transposes on load).
"""

from __future__ import annotations

import math
from pathlib import Path

from vlmd.tiny.checkpoint_io import restamp_json, save_model, write_json
from vlmd.tiny.weights import StdRule, random_model
from vlmd_qwen2_vl.tiny import SPECIAL_TOKENS, build_tokenizer
from vlmd_qwen3_vl.tiny import CHAT_TEMPLATE, IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS, PARAM_STD, SIZES, qwen3_vl_config
from vlmd_qwen3_vl.tiny import write_processor_files

__all__ = ["MOE", "build_tiny_qwen3_vl_moe"]

MOE = {"tiny": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                    mlp_only_layers=[1])}


def _param_std(hidden: int, intermediate: int) -> StdRule:
    """Qwen3-VL's rule, with the experts' fan-in (their last dimension in transformers' layout)."""
    return StdRule(fixed=[*PARAM_STD.fixed,
                          (("experts.gate_up_proj",), 0.0, 0.5 / math.sqrt(hidden)),
                          (("experts.down_proj",), 0.0, 0.5 / math.sqrt(intermediate))],
                   gains=[*PARAM_STD.gains, ((".mlp.gate.weight",), 1.0)])


def build_tiny_qwen3_vl_moe(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Qwen3-VL-MoE checkpoint into ``out_dir`` and return its path."""
    if size not in MOE:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(MOE)}")
    from transformers import GenerationConfig, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed, SIZES[size]["vocab_size"], CHAT_TEMPLATE)
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    dense = qwen3_vl_config(size, vocab_size=len(tokenizer), ids=ids).to_dict()
    dense["text_config"].update(MOE[size])
    for key in ("architectures", "model_type", "transformers_version"):
        dense.pop(key, None)
    for part in ("text_config", "vision_config"):
        dense[part].pop("model_type", None)
    config = Qwen3VLMoeConfig(**dense)
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]

    text = config.text_config
    rule = _param_std(text.hidden_size, text.moe_intermediate_size)
    model = random_model(Qwen3VLMoeForConditionalGeneration, config, seed, rule, sorted(ids.values()))
    eos_ids = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"]
    )
    save_model(model, out)
    restamp_json(out, "config.json", "generation_config.json")
    write_processor_files(out, tokenizer)
    write_json(out / "vlmd_tiny.json", {
        "family": "qwen3_vl_moe", "size": size, "seed": int(seed),
        "num_parameters": int(sum(p.numel() for p in model.parameters())), "vocab_size": len(tokenizer),
        "eos_token_ids": eos_ids, "pad_token_id": ids["<|endoftext|>"], "image_token_id": ids["<|image_pad|>"],
        "image_min_pixels": IMAGE_MIN_PIXELS, "image_max_pixels": IMAGE_MAX_PIXELS,
    })
    return out
