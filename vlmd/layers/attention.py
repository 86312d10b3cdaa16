"""Attention over the paged KV cache, in plain torch.

The cache of one layer is a pair of tensors ``[num_blocks * block_size, kv_heads, head_dim]``
addressed by slot = block_id * block_size + offset. Each step writes the new tokens' K/V
into their slots, then:
- decodes (one query token each) are batched: their context slots are gathered into a
  padded ``[B, L]`` index built once per step and shared by every layer;
- prefill chunks run one request at a time; a chunk with no earlier context attends only
  to itself (causal, no gather), a later chunk gathers its earlier context from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    start: int  # first row in the flattened token batch
    end: int
    context_slots: torch.Tensor | None  # slots of all tokens up to ``end``; None if no earlier context
    mask: torch.Tensor | None  # [n, context] True = attend, with ``context_slots``


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int  # rows [0, num_decodes) are single-token decodes
    decode_slots: torch.Tensor | None  # [B, L] context slots, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] True = attend
    prefills: list[PrefillSpan]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    k_cache, v_cache = kv_cache
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]

    num_decodes = meta.num_decodes
    if num_decodes:
        keys = k_cache[meta.decode_slots].transpose(1, 2)  # [B, Hkv, L, D]
        values = v_cache[meta.decode_slots].transpose(1, 2)
        queries = q[:num_decodes].unsqueeze(2)  # [B, H, 1, D]
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )
        out[:num_decodes] = attended.squeeze(2)

    for span in meta.prefills:
        queries = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.context_slots is None:
            keys = k[span.start : span.end].transpose(0, 1).unsqueeze(0)
            values = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            keys = k_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
            values = v_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=span.mask, scale=scale, enable_gqa=gqa
            )
        out[span.start : span.end] = attended[0].transpose(0, 1)
    return out
