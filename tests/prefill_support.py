"""What the prefill attention kernels' tests share (paged_prefill.c, flash_bf16.c): a chunk's
queries over scattered cache blocks, and the float64 answer to compare against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_case(heads, kv_heads, n, dim, start, block_size, seed=0):
    """Scattered blocks holding start + n tokens; returns (q, k_cache, v_cache, table, keys,
    values), keys and values [heads, start + n, dim] as the queries' heads read them."""
    torch.manual_seed(seed)
    total = start + n
    needed = -(-total // block_size)
    num_blocks = needed + 4
    table = torch.randperm(num_blocks)[:needed].to(torch.int32)
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim)
    slots = (table.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:total]
    keys = k_cache[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    values = v_cache[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    return torch.randn(n, heads, dim), k_cache, v_cache, table, keys, values


def reference(q, keys, values, start, causal, dtype=torch.float64):
    """[n, H, D] attention of q (positions start..) against [H, total, D] keys and values,
    computed in ``dtype`` by torch's SDPA."""
    n, total = q.shape[0], keys.shape[1]
    mask = torch.ones(n, total, dtype=torch.bool)
    if causal:
        mask = mask.tril(start)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).to(dtype), keys.to(dtype), values.to(dtype),
                                         attn_mask=mask, scale=q.shape[-1] ** -0.5)
    return out.transpose(0, 1)
