"""Deterministic random Qwen3.5 checkpoints for tests (``Qwen3_5ForConditionalGeneration``).

Built from transformers' own config classes, so the checkpoint has the real architecture: a
hybrid text model whose ``layer_types`` (transformers' rule, ``full_attention_interval`` 4)
put three Gated DeltaNet layers before each gated full-attention layer (partial rotary 0.25
with interleaved M-RoPE, q/k RMSNorm, a sigmoid gate from ``q_proj``), RMSNorms that scale by
``1 + weight``, and Qwen3-VL's vision tower without DeepStack. The tokenizer, chat template
and processor files are Qwen3-VL's tiny ones (``vlmd_qwen3_vl.tiny``, the same special tokens
and pixel limits), written by its ``build_checkpoint``.

Weights follow ``vlmd.tiny.weights.StdRule`` with Qwen3.5's exceptions (``PARAM_STD``): the
text norms' weights around 0 (they are offsets from 1), the gated norm's around 1, and
``A_log`` around -3 so a delta-rule state decays by a few percent a token: what a prompt's
first chunk leaves in it still matters 64 tokens on, so a state lost between chunks shows in
the tokens.
"""

from __future__ import annotations

from pathlib import Path

from vlmd.tiny.weights import StdRule
from vlmd_qwen3_vl.tiny import PARAM_STD as QWEN3_VL_PARAM_STD
from vlmd_qwen3_vl.tiny import build_checkpoint, config_fields

__all__ = ["SIZES", "build_tiny_qwen3_5", "qwen3_5_config"]

SIZES: dict[str, dict] = {
    "tiny": {
        "vision": dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=16),
        # Two groups of three linear-attention layers and one full-attention layer.
        "text": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_conv_kernel_dim=4),
        # Rotary over a quarter of head_dim (16 columns, 8 frequencies): time, height, width.
        "mrope_section": [3, 3, 2],
    },
    # About 100M parameters, for benchmarks: 128-wide linear-attention heads (the size the
    # published checkpoints use, and the one vLLM's CPU Gated DeltaNet kernel takes).
    "small": {
        "vision": dict(depth=8, hidden_size=384, intermediate_size=1536, num_heads=6, num_position_embeddings=576),
        "text": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=128, max_position_embeddings=8192,
                     linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                     linear_value_head_dim=128, linear_conv_kernel_dim=4),
        "mrope_section": [6, 5, 5],  # 32 rotary columns of head_dim 128
    },
}


BASE_STD = StdRule(fixed=[*QWEN3_VL_PARAM_STD.fixed,
                         (("linear_attn.norm.weight",), 1.0, 0.1),  # a plain scale (RMSNormGated)
                         (("linear_attn.A_log",), -3.0, 1.0)],
                  gains=QWEN3_VL_PARAM_STD.gains)


class Qwen3_5ParamStd:
    """Qwen3-VL's tiny rule for the tower (``base``: Qwen3.5's gated norm and decay added);
    the text RMSNorms' weights around 0."""

    def __init__(self, base: StdRule = BASE_STD):
        self.base = base

    def __call__(self, name: str, shape: tuple[int, ...], is_norm: bool):
        if is_norm and ".visual." not in name and name.endswith("weight"):
            return 0.0, 0.1  # Qwen3_5RMSNorm scales by 1 + weight
        return self.base(name, shape, is_norm)


PARAM_STD = Qwen3_5ParamStd()


def qwen3_5_config(size: str, *, vocab_size: int, ids: dict[str, int]):
    """The ``Qwen3_5Config`` of a ``size`` checkpoint: Qwen3-VL's fields at Qwen3.5's sizes,
    rotary over a quarter of each head."""
    from transformers import Qwen3_5Config

    config = Qwen3_5Config(**config_fields(SIZES[size], vocab_size=vocab_size, ids=ids,
                                           rope={"partial_rotary_factor": 0.25}))
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config


def build_tiny_qwen3_5(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Qwen3.5 checkpoint into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")

    def hybrid(vocab_size: int, ids: dict[str, int]):
        from transformers import Qwen3_5ForConditionalGeneration

        return Qwen3_5ForConditionalGeneration, qwen3_5_config(size, vocab_size=vocab_size, ids=ids), PARAM_STD

    return build_checkpoint(out_dir, seed, size, "qwen3_5", hybrid)
