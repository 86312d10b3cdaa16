"""Paged attention behind a backend interface (backend.py), picked per device (registry.py).

The model calls one function, :func:`paged_attention`; the step's metadata names the
backend that built it, so the model never chooses or inspects one.
"""

from __future__ import annotations

import torch

from vlmd.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    CrossSpan,
    LayerCache,
    OutputRows,
    SequenceChunk,
    cross_kv,
    layer_group,
    write_kv,
)
from vlmd.layers.attention.registry import attention_backend_for, register_attention_backend


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D] this step's keys, every row
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
) -> None:
    """Write this step's K/V into the layer's cache without attending (a layer whose queries
    attend for some rows only, ``OutputRows``): through the tables of the layer's KV group."""
    write_kv(kv_cache, k, v, meta.for_group(layer_group(kv_cache, meta)).slot_mapping)


def cross_attention(
    q: torch.Tensor,  # [R, H, D]
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # a cross-attention layer's (its KV group's slot)
    meta: AttentionMetadata,
    scale: float,
    spans: list[CrossSpan],
) -> torch.Tensor:
    """Cross-attention to each span's sequence's encoder K/V, which the runner wrote into the
    sequence's table of the cross-attention group; returns [R, H, D] (rows no span covers: 0)."""
    return meta.backend.cross_forward(q, kv_cache, scale, spans)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the layer's cache, then attend; returns [T, H, D].
    ``window``: a sliding-window layer's reach in tokens (None: a full-attention layer)."""
    return meta.backend.forward(q, k, v, kv_cache, meta, scale, window)


def shared_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # its source layer's (runner/kv_cache.layer_caches)
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of a layer that keeps no K/V of its own (``SharedKV``): over the K/V its
    source layer wrote, this step's included, writing nothing; returns [T, H, D]."""
    return meta.backend.forward_shared(q, kv_cache, meta, scale, window)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CrossSpan",
    "LayerCache",
    "OutputRows",
    "SequenceChunk",
    "attention_backend_for",
    "cross_attention",
    "cross_kv",
    "paged_attention",
    "register_attention_backend",
    "shared_attention",
    "store_kv",
    "write_kv",
]
