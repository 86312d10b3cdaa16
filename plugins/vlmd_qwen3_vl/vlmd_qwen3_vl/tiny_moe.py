"""Deterministic random Qwen3-VL-MoE checkpoints for tests (``Qwen3VLMoeForConditionalGeneration``).

Qwen3-VL's tiny checkpoint (``tiny.py``: the same tower, tokenizer, template and processor
files) with a mixture of experts in the text model: 8 experts, 2 a token, and one dense
layer (``mlp_only_layers``) so both kinds of layer are exercised. The experts are fused 3D
tensors, stored as published checkpoints store them (transformers transposes on load).
"""

from __future__ import annotations

import math
from pathlib import Path

from vlmd.tiny.weights import StdRule
from vlmd_qwen3_vl.tiny import PARAM_STD, build_checkpoint, qwen3_vl_config

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

    def with_experts(vocab_size: int, ids: dict[str, int]):
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

        dense = qwen3_vl_config(size, vocab_size=vocab_size, ids=ids).to_dict()
        dense["text_config"].update(MOE[size])
        for key in ("architectures", "model_type", "transformers_version"):
            dense.pop(key, None)
        for part in ("text_config", "vision_config"):
            dense[part].pop("model_type", None)
        config = Qwen3VLMoeConfig(**dense)
        config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
        rule = _param_std(config.text_config.hidden_size, config.text_config.moe_intermediate_size)
        return Qwen3VLMoeForConditionalGeneration, config, rule

    return build_checkpoint(out_dir, seed, size, "qwen3_vl_moe", with_experts)
