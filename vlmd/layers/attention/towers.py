"""Attention for the encoders we run as transformers modules (vision towers): the
``"vlmd"`` attention implementation.

A family's model sets ``config._attn_implementation = TOWER_ATTENTION`` on the tower's config
(after importing this module, which registers it with transformers' ``AttentionInterface``).
Each call that bfloat16 attention by AVX512-BF16 serves (CPU, no mask, no dropout, not
causal, a head size ``flash_bf16.serves``) runs ``flash_bf16.c`` per item; every other call
(float32, a mask, a host without the instruction) is transformers' own SDPA function,
unchanged, so a float32 tower computes what transformers computes.

Why a tower needs it: a 577-token CLIP image (8 heads of 64) took 6.9 ms a layer in
torch's bfloat16 flash kernel against 3.5 ms in ``flash_bf16.c`` (AMD EPYC family 25 model
17, 2 threads: 98 against 195 GFLOP/s).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlmd.layers.cpu import flash_bf16

TOWER_ATTENTION = "vlmd"

_ONE_BLOCK = torch.zeros(1, dtype=torch.int32)


def _served(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float,
            is_causal: bool | None, kwargs: dict) -> bool:
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return (query.dtype == torch.bfloat16 and query.device.type == "cpu" and attention_mask is None
            and not dropout and not causal and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False) and query.shape[1] % key.shape[1] == 0
            and query.shape[2] == key.shape[2] and flash_bf16.serves(query.shape[-1]))


def tower_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, N, D], key / value [B, Hkv, N, D];
    returns ([B, N, H, D], None)."""
    if not _served(module, query, key, attention_mask, dropout, is_causal, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, tokens, dim = query.shape
    scale = dim ** -0.5 if scaling is None else scaling
    # [B, N, H, D]: the towers project then transpose, so these are views of contiguous rows.
    queries = query.transpose(1, 2)
    if queries.stride(-1) != 1 or queries.stride(2) != dim:
        queries = queries.contiguous()
    keys, values = key.transpose(1, 2).contiguous(), value.transpose(1, 2).contiguous()
    out = torch.empty(batch, tokens, heads, dim, dtype=query.dtype)
    for item in range(batch):
        # An item's keys are a one-block cache of `tokens` slots.
        flash_bf16.flash_bf16(queries[item], keys[item], values[item], _ONE_BLOCK, tokens, 0, scale, out[item],
                              causal=False)
    return out, None


AttentionInterface.register(TOWER_ATTENTION, tower_attention)
