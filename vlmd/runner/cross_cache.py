"""Cross-attention K/V in the shared KV pool: written once per request, read every step.

An encoder-decoder's prepare step (``prepare_cross_attention`` /
``prepare_request_cross_attention``) turns a request's encoder output into every
cross-attention layer's K and V; the runner writes them into the request's table in the
cross-attention group (``NewRequestData.block_tables``, taken whole by the scheduler from the
pool every group shares: sched/kv_managers.py) and lets go of them. Each step the model gets a
:class:`CrossSource` per request (its table, its encoder tokens, its family state) and the
cross-attention layers' caches; the attention backend reads the K/V through the table
(``layers/attention/backend.py:cross_kv``: a view where the table is one run of blocks, the
usual case, a gather otherwise) and attends (``cross_attention``; docs/decisions.md D93, D95).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmd.layers.attention import CrossSpan
from vlmd.layers.attention.backend import cross_region
from vlmd.sched.block_pool import blocks_needed

LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CrossSource:
    """One request's cross-attention memory as a step reads it: its table in the
    cross-attention group, its encoder tokens, and its family state (where its tokens sit:
    Llama 3.2 Vision's layout)."""

    table: Sequence[int]
    num_tokens: int
    family_state: Any = None

    def span(self, first: int, end: int, mask: torch.Tensor | None = None) -> CrossSpan:
        """Rows ``[first, end)`` of a layer's queries attending to this request's tokens."""
        return CrossSpan(first, end, self.table, self.num_tokens, mask)


class CrossCache:
    """The cross-attention layers' K/V: each layer's slot tensors of the shared pool
    (``[blocks * block_size, kv_heads, head_dim]``), addressed by the cross group's tables."""

    def __init__(self, layers: Sequence[LayerKV], block_size: int, group: int):
        self.block_size = block_size
        self.group = group  # the cross-attention KV group whose tables these are
        self.layers = list(layers)

    def write(self, table: Sequence[int], num_tokens: int, layers: Sequence[LayerKV]) -> None:
        """Store a request's K/V (per layer ``[kv_heads, num_tokens, head_dim]``) in its table."""
        if len(layers) != len(self.layers):
            raise RuntimeError(f"the model prepared {len(layers)} cross-attention layers, the cache has {len(self.layers)}")
        if len(table) != blocks_needed(num_tokens, self.block_size) or not table:
            raise RuntimeError(f"a cross-attention table of {len(table)} blocks for {num_tokens} tokens")
        # The layout the backend reads (cross_kv): a run of blocks holds the heads first.
        start = cross_region(table, self.block_size)
        slots = None
        if start is None:
            blocks = torch.tensor(list(table), dtype=torch.long)
            slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).flatten()[:num_tokens]
            slots = slots.to(self.layers[0][0].device)
        for (k_cache, v_cache), (k, v) in zip(self.layers, layers):
            if k.shape[1] != num_tokens or v.shape[1] != num_tokens:
                raise RuntimeError(f"the model prepared cross-attention K/V of {k.shape[1]} tokens for a request "
                                   f"of {num_tokens}")
            if start is not None:
                heads, dim = k_cache.shape[1], k_cache.shape[2]
                k_cache[start:start + num_tokens].view(heads, num_tokens, dim).copy_(k)
                v_cache[start:start + num_tokens].view(heads, num_tokens, dim).copy_(v)
            else:
                k_cache.index_copy_(0, slots, k.transpose(0, 1).to(k_cache.dtype))
                v_cache.index_copy_(0, slots, v.transpose(0, 1).to(v_cache.dtype))


def cross_states(batch, cache: CrossCache | None, encoder_outputs: Mapping[str, torch.Tensor],
                 prepare: Callable[[list[torch.Tensor], Any], Sequence[LayerKV]],
                 every_request_attends: bool) -> list[tuple[int, int, CrossSource | None]]:
    """(first row, end row, cross source) per request of a step (a ``runner/batch.py``
    batch), for an encoder-decoder model.

    A request's cross-attention K/V (every cross layer's) are derived once, by ``prepare``
    from the encoder outputs of its items without placeholders (all of them at once, in
    prompt order, with the request's family state), in the chunk that covers the items'
    offset, and written into its cross table, where they stay until the request is dropped
    (finished, aborted or preempted: the scheduler frees the blocks), so the encoder output
    itself may be evicted. Each step the backend reads them back through the table. A request
    without such items has no cross K/V (None: the model skips cross-attention for its rows), which
    only a model that attends to several optional items allows (``every_request_attends``
    False: Llama 3.2 Vision; Whisper needs its audio).
    """
    spans = []
    for piece in batch.slices:
        state = piece.state
        # A request admitted past its items' offsets (a prefix hit) has no cross K/V yet:
        # its first chunk derives them from every item before the chunk's end.
        reached = [item for item in state.mm_items if item.length == 0 and item.offset < piece.end
                   and (piece.start <= item.offset or not state.cross_ready)]
        outputs = []
        for item in reached:
            output = encoder_outputs.get(item.identifier)
            if output is None:
                raise RuntimeError(f"encoder output for {item.modality} item {item.identifier[:12]} is missing")
            outputs.append(output)
        if outputs:
            if cache is None:
                raise RuntimeError("cross-attention items reached a runner without cross-attention layers")
            table = state.block_tables.get(cache.group, [])
            cache.write(table, state.num_cross_tokens, prepare(outputs, state.family_state))
            state.cross_ready = True
        if not state.cross_ready and (every_request_attends or any(item.length == 0 for item in state.mm_items)):
            raise RuntimeError(f"request {state.request_id} has no encoder input for the decoder to attend to")
        cross = None
        if state.cross_ready:
            cross = CrossSource(state.block_tables[cache.group], state.num_cross_tokens, state.family_state)
        spans.append((piece.row, piece.row + piece.count, cross))
    return spans
