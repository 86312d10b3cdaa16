"""Deterministic random Qwen3.5-MoE checkpoints for tests (``Qwen3_5MoeForConditionalGeneration``).

Qwen3.5's tiny checkpoint (``tiny.py``: the same tower, hybrid layer layout, tokenizer,
template and processor files) with a mixture of experts on every text layer: 8 experts, 2 a
token, and the shared expert with its sigmoid gate. The experts are the fused 3D tensors
transformers keeps and saves for this class.
"""

from __future__ import annotations

import math
from pathlib import Path

from vlmd.tiny.weights import StdRule
from vlmd_qwen3_5.tiny import PARAM_STD, Qwen3_5ParamStd, qwen3_5_config
from vlmd_qwen3_vl.tiny import build_checkpoint

__all__ = ["MOE", "build_tiny_qwen3_5_moe"]

# Six layers (linear, linear, linear, full, linear, linear): the last one a linear-attention
# layer, so a step's last layer advances every row's state before keeping the sampled rows.
MOE = {"tiny": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                    shared_expert_intermediate_size=48, num_hidden_layers=6)}


def _param_std(hidden: int, intermediate: int) -> Qwen3_5ParamStd:
    """Qwen3.5's rule, the experts drawn at their fan-in (the last dimension of transformers'
    ``[experts, out, in]`` tensors) and the router sharp."""
    base = PARAM_STD.base
    return Qwen3_5ParamStd(StdRule(fixed=[*base.fixed,
                                          (("experts.gate_up_proj",), 0.0, 0.5 / math.sqrt(hidden)),
                                          (("experts.down_proj",), 0.0, 0.5 / math.sqrt(intermediate))],
                                   gains=[*base.gains, ((".mlp.gate.weight",), 1.0)]))


def build_tiny_qwen3_5_moe(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Qwen3.5-MoE checkpoint into ``out_dir`` and return its path."""
    if size not in MOE:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(MOE)}")

    def with_experts(vocab_size: int, ids: dict[str, int]):
        from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

        dense = qwen3_5_config(size, vocab_size=vocab_size, ids=ids).to_dict()
        for key in ("intermediate_size", "layer_types"):  # no dense MLP; the layout follows the layer count
            dense["text_config"].pop(key, None)
        dense["text_config"].update(MOE[size])
        for key in ("architectures", "model_type", "transformers_version"):
            dense.pop(key, None)
        for part in ("text_config", "vision_config"):
            dense[part].pop("model_type", None)
        config = Qwen3_5MoeConfig(**dense)
        config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
        rule = _param_std(config.text_config.hidden_size, config.text_config.moe_intermediate_size)
        return Qwen3_5MoeForConditionalGeneration, config, rule

    return build_checkpoint(out_dir, seed, size, "qwen3_5_moe", with_experts)
