"""Allocating the paged KV tensors: per layer, sized by its KV group's blocks."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from vlmd.models.base import KVSpec


def bytes_per_block(spec: KVSpec, block_size: int, dtype: torch.dtype) -> int:
    """A block in every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * element


def group_bytes_per_block(spec: KVSpec, block_size: int, dtype: torch.dtype, window: int | None) -> int:
    """A block in the layers of ``window`` (None: the full-attention layers)."""
    return spec.layer_bytes_per_token(torch.empty((), dtype=dtype).element_size(), window) * block_size


def num_blocks_for(spec: KVSpec, block_size: int, dtype: torch.dtype, cache_bytes: float) -> int:
    return int(cache_bytes // bytes_per_block(spec, block_size, dtype))


def allocate_kv_caches(
    spec: KVSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | None = None,
    window_blocks: Mapping[int, int] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each ``[blocks * block_size, kv_heads, head_dim]``: a layer
    whose window has a group of its own (``window_blocks``: window -> its pool's blocks) has
    that group's blocks, every other layer ``num_blocks``.

    Zeroed, not empty: padded gather positions are masked out of softmax, but a NaN left
    in an unused slot would still poison the weighted sum (0 * NaN). On the CPU numpy's
    zeros come from calloc, so pages are zeroed by the kernel on first touch instead of
    memset up front: a large cache costs nothing until it is used. On CUDA the cache is
    allocated (and zeroed) on the device at once: the memory plan gave it that memory.
    """
    window_blocks = window_blocks or {}
    caches = []
    for layer in range(spec.num_layers):
        blocks = window_blocks.get(spec.window_of(layer), num_blocks)
        shape = (blocks * block_size, spec.num_kv_heads, spec.head_dim)
        if device is not None and device.type != "cpu":
            caches.append((torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)))
        else:
            caches.append((_lazy_zeros(shape, dtype), _lazy_zeros(shape, dtype)))
    return caches


def allocate_cross_caches(
    spec: KVSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per cross-attention layer over the cross pool, each ``[kv_heads,
    blocks * block_size, head_dim]``: heads first, so a request's consecutive blocks are one
    strided view ``[kv_heads, tokens, head_dim]`` that attention reads as it is (no copy).
    Zeroed like the paged cache, lazily on the CPU."""
    shape = (spec.num_kv_heads, num_blocks * block_size, spec.head_dim)
    if device is not None and device.type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(spec.num_cross_layers)]
    return [(_lazy_zeros(shape, dtype), _lazy_zeros(shape, dtype)) for _ in range(spec.num_cross_layers)]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
    return torch.from_numpy(raw).view(dtype)
