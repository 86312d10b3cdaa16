"""A linear-attention layer's per-request state, kept in the pages of its KV group.

A Gated DeltaNet layer keeps, per request, the last ``kernel - 1`` inputs of its causal
convolution per channel and a ``[key_dim, value_dim]`` delta-rule matrix per value head:
a fixed size whatever the request's length. The KV model gives such layers the kind
``RecurrentState(bytes)`` (``vlmd/sched/kv_spec.py``): they form their own groups, and a
request's table in such a group is ``blocks_per_request`` pages of the one shared pool
(taken whole at its first allocation, a run of consecutive ids where the pool has one).
The ``j``-th layer of the group keeps its state in slot ``j`` of those pages.

Where in the pages (``RecurrentStateLayout``): the state is one float32 vector (the
convolution's entries, then the delta-rule matrices), rounded up to an even length; its
first half lies in the K rows of the request's pages in the layer's slot, its second half
in the V rows. float32 whatever the model's dtype: transformers keeps the delta-rule state
in float32, and a bfloat16 state would drift over a long request.

The layer never sees pages: ``read_states`` gives it this step's sequences' states as
tensors, ``write_states`` hands back its new ones, which the runner stores once the whole
step has run (``commit_states``): a step re-run to find the request that made it fail
(engine/isolation.py) must start again from the states before it, as attention layers
rewrite the same K/V. A sequence whose chunk starts at position 0 reads zeros (a fresh
request: its pages may hold an earlier request's bytes). A request resumed from a prefix
hit starts from a state the runner copied into its pages (D105).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlmd.layers.attention.backend import AttentionMetadata, layer_group

_FLOAT32_BYTES = 4


@dataclass(frozen=True)
class RecurrentStateLayout:
    """One layer's state per request: ``conv [conv_channels, conv_kernel - 1]`` and
    ``recurrent [heads, key_dim, value_dim]``, float32."""

    conv_channels: int
    conv_kernel: int
    heads: int
    key_dim: int
    value_dim: int

    def __post_init__(self) -> None:
        if self.conv_kernel < 2:
            raise ValueError(f"a causal convolution keeps kernel - 1 inputs: kernel {self.conv_kernel} keeps none")
        if min(self.conv_channels, self.heads, self.key_dim, self.value_dim) < 1:
            raise ValueError(f"a recurrent state of {self} has no size")

    @property
    def conv_elements(self) -> int:
        return self.conv_channels * (self.conv_kernel - 1)

    @property
    def recurrent_elements(self) -> int:
        return self.heads * self.key_dim * self.value_dim

    @property
    def elements(self) -> int:
        """float32 entries, an even count: half in the K rows, half in the V rows."""
        total = self.conv_elements + self.recurrent_elements
        return total + total % 2

    @property
    def bytes_per_request(self) -> int:
        """What the family declares for the layer (``KVSpec.layer_state_bytes``)."""
        return self.elements * _FLOAT32_BYTES


def _page_floats(cache: torch.Tensor, block_size: int) -> int:
    page_bytes = block_size * cache.shape[1] * cache.shape[2] * cache.element_size()
    if page_bytes % _FLOAT32_BYTES:
        raise ValueError(f"a KV page of {page_bytes} bytes cannot hold float32 state")
    return page_bytes // _FLOAT32_BYTES


def _region(cache: torch.Tensor, table: Sequence[int], block_size: int, floats: int) -> list[torch.Tensor]:
    """The first ``floats`` float32 entries of ``table``'s pages in one of a slot's tensors,
    as views: one where the pages are a run of consecutive ids, else one per page."""
    if not cache.is_contiguous():
        # A layer narrower than its pool slot (KVSpec.layer_head_dims, D111) sees a strided
        # view of the rows: a state read as a flat vector there would miss its values.
        raise ValueError("a recurrent state needs its slot's whole rows: a layer narrower than the slot has none")
    per_page = _page_floats(cache, block_size)
    needed = -(-floats // per_page)
    if len(table) < needed:
        raise RuntimeError(f"a recurrent state of {floats * _FLOAT32_BYTES} bytes per half needs {needed} "
                           f"pages, the request's table has {len(table)}")
    pages = list(table[:needed])
    runs: list[tuple[int, int]] = []  # (first page, pages) of each run of consecutive ids
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    views, left = [], floats
    for first, count in runs:
        rows = cache[first * block_size:(first + count) * block_size]
        view = rows.reshape(-1).view(torch.float32)[:min(left, count * per_page)]
        views.append(view)
        left -= view.numel()
    return views


def _sequence_tables(kv_cache, meta: AttentionMetadata) -> tuple[list[list[int]], list[int]]:
    group = layer_group(kv_cache, meta)
    chunks = [chunk.for_group(group) for chunk in meta.chunks]
    return [chunk.block_ids for chunk in chunks], [chunk.start for chunk in chunks]


def read_states(kv_cache, meta: AttentionMetadata, layout: RecurrentStateLayout
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's sequences' states, in batch order: ``conv [S, channels, kernel - 1]`` and
    ``recurrent [S, heads, key_dim, value_dim]``, float32 copies (zeros for a sequence that
    starts at position 0)."""
    k_cache, v_cache = kv_cache
    tables, starts = _sequence_tables(kv_cache, meta)
    block_size = meta.backend.block_size
    half = layout.elements // 2
    flat = torch.empty(len(tables), layout.elements, dtype=torch.float32, device=k_cache.device)
    for row, (table, start) in enumerate(zip(tables, starts)):
        if start == 0:
            flat[row] = 0.0
            continue
        offset = 0
        for cache in (k_cache, v_cache):
            for view in _region(cache, table, block_size, half):
                flat[row, offset:offset + view.numel()] = view
                offset += view.numel()
    conv_end = layout.conv_elements
    conv = flat[:, :conv_end].view(len(tables), layout.conv_channels, layout.conv_kernel - 1)
    recurrent = flat[:, conv_end:conv_end + layout.recurrent_elements].view(
        len(tables), layout.heads, layout.key_dim, layout.value_dim)
    return conv, recurrent


def write_states(kv_cache, meta: AttentionMetadata, layout: RecurrentStateLayout, conv: torch.Tensor,
                 recurrent: torch.Tensor) -> None:
    """This step's sequences' new states (shapes as ``read_states`` gives them), stored by
    ``commit_states`` once the step has run."""
    tables, _ = _sequence_tables(kv_cache, meta)
    expected_conv = (len(tables), layout.conv_channels, layout.conv_kernel - 1)
    expected_recurrent = (len(tables), layout.heads, layout.key_dim, layout.value_dim)
    if tuple(conv.shape) != expected_conv or tuple(recurrent.shape) != expected_recurrent:
        raise ValueError(f"states of shapes {tuple(conv.shape)} and {tuple(recurrent.shape)} for "
                         f"{expected_conv} and {expected_recurrent}")
    meta.pending_states.append((kv_cache, tables, layout, conv, recurrent))


def commit_states(meta: AttentionMetadata) -> None:
    """Store the states the step's layers handed to ``write_states`` (the runner calls this
    once the whole step has run)."""
    metas = [meta, *meta._groups.values()]
    for each in metas:
        pending, each.pending_states = each.pending_states, []
        for kv_cache, tables, layout, conv, recurrent in pending:
            _store(kv_cache, tables, meta.backend.block_size, layout, conv, recurrent)


def _store(kv_cache, tables: list[list[int]], block_size: int, layout: RecurrentStateLayout, conv: torch.Tensor,
           recurrent: torch.Tensor) -> None:
    k_cache, v_cache = kv_cache
    half = layout.elements // 2
    rows = len(tables)
    pad = layout.elements - layout.conv_elements - layout.recurrent_elements
    parts = [conv.reshape(rows, -1).float(), recurrent.reshape(rows, -1).float()]
    if pad:
        parts.append(torch.zeros(rows, pad, dtype=torch.float32, device=k_cache.device))
    flat = torch.cat(parts, dim=1)
    for row, table in enumerate(tables):
        offset = 0
        for cache in (k_cache, v_cache):
            for view in _region(cache, table, block_size, half):
                view.copy_(flat[row, offset:offset + view.numel()])
                offset += view.numel()
