"""The KV tensors of the one pool every KV group shares (``vlmd/sched/kv_spec.py``).

A page (block id) has ``num_slots`` layer slots: slot ``j`` is a pair of tensors ``[blocks *
block_size, slot_width]`` (K and V, each layer's heads x head size in a row's first values), and the ``j``-th layer of every group keeps its
K/V there, at the rows of its group's blocks. So a block a window gave back is rows of the
same tensors that a full-attention or cross-attention group writes next.
"""

from __future__ import annotations

import numpy as np
import torch

from vlmd.layers.attention.backend import LayerCache
from vlmd.models.base import KVSpec
from vlmd.sched.kv_spec import KVCacheConfig


def allocate_kv_slots(spec: KVSpec, config: KVCacheConfig, dtype: torch.dtype,
                      device: torch.device | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pool's tensors: one (K, V) pair per layer slot, each ``[num_blocks * block_size,
    slot_width]`` (``layer_caches`` views each layer's as ``[rows, kv_heads, head_dim]``).

    Zeroed, not empty: padded gather positions are masked out of softmax, but a NaN left
    in an unused slot would still poison the weighted sum (0 * NaN). On the CPU numpy's
    zeros come from calloc, so pages are zeroed by the kernel on first touch instead of
    memset up front: a large cache costs nothing until it is used. On CUDA the cache is
    allocated (and zeroed) on the device at once: the memory plan gave it that memory.
    """
    shape = (config.num_blocks * config.block_size, spec.slot_width)
    if device is not None and device.type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(config.num_slots)]
    return [(_lazy_zeros(shape, dtype), _lazy_zeros(shape, dtype)) for _ in range(config.num_slots)]


def layer_caches(config: KVCacheConfig, slots: list[tuple[torch.Tensor, torch.Tensor]], layers: range,
                 spec: KVSpec) -> list[LayerCache]:
    """The caches of KV-model layers ``layers``: each its slot's tensors and its group (a
    ``SharedKV`` layer's are its source's: same group, same slot), viewed as ``[rows,
    kv_heads, head_dim]``: a layer narrower than the slot (``layer_head_dims``,
    ``layer_kv_heads``) sees the first ``kv_heads x head_dim`` values of each row."""
    caches = []
    for layer in layers:
        k_slot, v_slot = slots[config.layer_slot[layer]]
        heads, dim = spec.kv_heads_of(layer), spec.head_dim_of(layer)
        rows = k_slot.shape[0]
        caches.append(LayerCache(k_slot[:, :heads * dim].view(rows, heads, dim),
                                 v_slot[:, :heads * dim].view(rows, heads, dim), config.layer_group[layer]))
    return caches


def copy_pages(config: KVCacheConfig, slots: list[tuple[torch.Tensor, torch.Tensor]], group: int,
               source: list[int], target: list[int]) -> None:
    """Copy pages ``source`` onto pages ``target`` in every layer slot of KV group ``group``
    (K and V rows alike): a recurrent state into its snapshot, or a snapshot into the state
    of a request that starts from it (D105)."""
    if len(source) != len(target):
        raise ValueError(f"copying {len(source)} pages onto {len(target)}")
    if not source:
        return
    block_size = config.block_size
    device = slots[0][0].device
    offsets = torch.arange(block_size)
    rows_from = (torch.tensor(source)[:, None] * block_size + offsets).flatten().to(device)
    rows_to = (torch.tensor(target)[:, None] * block_size + offsets).flatten().to(device)
    for slot in range(len(config.groups[group].layers)):
        for cache in slots[slot]:
            cache.index_copy_(0, rows_to, cache.index_select(0, rows_from))


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
    return torch.from_numpy(raw).view(dtype)
