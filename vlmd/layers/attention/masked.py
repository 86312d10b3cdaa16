"""Attention with a mask beyond causal: sliding-window layers and bidirectional spans.

Two patterns that a causal-only backend computes wrongly (as transformers builds them from
``sliding_window`` and ``token_type_ids`` for the models that use them):

- a **sliding-window layer** lets the query at position ``p`` see keys at positions
  ``k > p - window`` only;
- a **bidirectional span** ``[a, b)`` (an image's tokens) lets every query in it see every
  key in it, later ones included. Everything else stays causal; in a windowed layer the
  span is still cut by the window (transformers: ``AND(window, OR(causal, span))``).

A windowed layer reads at most ``window - 1`` cached tokens per sequence, so its keys are
gathered through the block table into one bounded copy and attended in one masked call
per prefill chunk, and one padded call for every decode of the step (``WindowPlan``). On
the CPU a windowed layer's decodes take the native decode kernel instead, which reads the
window in place (``cpu_paged.py``); its prefill chunks always run here, in torch. A
full-attention layer keeps the paged backend's in-place reads of the context (every
cached token precedes the chunk, so no mask applies there) and only masks a chunk's own
tokens (``span_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vlmd.layers.attention.backend import SequenceChunk


def check_spans(chunk: SequenceChunk) -> None:
    """A span that the chunk's queries reach must end inside the chunk (its later keys are
    computed in this step or not at all); a scheduler that splits an item breaks this."""
    end = chunk.start + chunk.count
    for first, stop in chunk.spans:
        if first >= stop:
            raise ValueError(f"bidirectional span [{first}, {stop}) is empty")
        if first < end < stop:
            raise ValueError(
                f"bidirectional span [{first}, {stop}) is cut by a chunk ending at {end}: "
                "an item's tokens must be scheduled in one step"
            )


def span_ids(positions: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Which span each position is in (its index), or -1 for none."""
    ids = torch.full(positions.shape, -1, dtype=torch.long)
    for index, (first, stop) in enumerate(spans):
        ids[(positions >= first) & (positions < stop)] = index
    return ids


def visibility(query_positions: torch.Tensor, key_positions: torch.Tensor, spans: tuple[tuple[int, int], ...],
               window: int | None) -> torch.Tensor:
    """[n, L] True where the query may attend to the key: causal, or both in one span, and
    (in a windowed layer) the key within the window."""
    q = query_positions.unsqueeze(1)
    k = key_positions.unsqueeze(0)
    allowed = k <= q
    if spans:
        q_span, k_span = span_ids(query_positions, spans).unsqueeze(1), span_ids(key_positions, spans).unsqueeze(0)
        allowed |= (q_span == k_span) & (q_span >= 0)
    if window is not None:
        allowed &= k > q - window
    return allowed


def span_mask(chunk: SequenceChunk) -> torch.Tensor | None:
    """The additive mask ([n, n], 0 or -inf) of a chunk's own tokens in a full-attention
    layer where a span reaches them, or None: plain causal then."""
    end = chunk.start + chunk.count
    spans = tuple(span for span in chunk.spans if span[0] < end and span[1] > chunk.start)
    if not spans:
        return None
    positions = torch.arange(chunk.start, end)
    allowed = visibility(positions, positions, spans, None)
    return torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))


def key_slots(block_ids: list[int], first: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [first, end) of a block table."""
    positions = torch.arange(first, end)
    blocks = torch.tensor(block_ids[first // block_size: -(-end // block_size)], dtype=torch.long)
    return blocks[positions // block_size - first // block_size] * block_size + positions % block_size


@dataclass
class WindowedChunk:
    rows: tuple[int, int]  # [first, end) rows of the flattened batch
    slots: torch.Tensor  # [L] its keys: the window's cached tokens, then its own
    mask: torch.Tensor  # [1, 1, n, L] True = attend


@dataclass
class WindowPlan:
    """One step's reads for layers of one window: built once, shared by those layers."""

    decode_slots: torch.Tensor | None  # [B, L] each decode's window, padded with slot 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] True = a real key; None when none is padded
    chunks: list[WindowedChunk] = field(default_factory=list)
    _on_device: dict = field(default_factory=dict)

    def on(self, device: torch.device) -> "WindowPlan":
        """This plan with its tensors on ``device`` (built on the host; moved once a step)."""
        if device.type == "cpu":
            return self
        if device not in self._on_device:
            move = (lambda t: None if t is None else t.to(device))
            self._on_device[device] = WindowPlan(
                move(self.decode_slots), move(self.decode_mask),
                [WindowedChunk(c.rows, move(c.slots), move(c.mask)) for c in self.chunks],
            )
        return self._on_device[device]


def plan_window(decodes: list[SequenceChunk], prefills: list[SequenceChunk], block_size: int,
                window: int) -> WindowPlan:
    """The keys each sequence's queries can reach in a layer of ``window``, through the
    chunks' tables (the layer's group's: only entries inside the window are read, those
    before it may have been given back)."""
    decode_slots = decode_mask = None
    if decodes:
        firsts = [max(0, chunk.start - window + 1) for chunk in decodes]
        parts = [key_slots(chunk.block_ids, first, chunk.start + 1, block_size)
                 for chunk, first in zip(decodes, firsts)]
        width = max(part.numel() for part in parts)
        decode_slots = torch.zeros(len(parts), width, dtype=torch.long)
        for row, part in enumerate(parts):
            decode_slots[row, : part.numel()] = part
        if any(part.numel() < width for part in parts):
            counts = torch.tensor([part.numel() for part in parts])
            decode_mask = (torch.arange(width).unsqueeze(0) < counts.unsqueeze(1)).view(len(parts), 1, 1, width)
    plan = WindowPlan(decode_slots, decode_mask)
    row = len(decodes)
    for chunk in prefills:
        end = chunk.start + chunk.count
        first = max(0, chunk.start - window + 1)
        allowed = visibility(torch.arange(chunk.start, end), torch.arange(first, end), chunk.spans, window)
        plan.chunks.append(WindowedChunk(
            (row, row + chunk.count), key_slots(chunk.block_ids, first, end, block_size),
            allowed.view(1, 1, chunk.count, -1),
        ))
        row += chunk.count
    return plan


def attend_windowed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: WindowPlan,
                    num_decodes: int, scale: float) -> torch.Tensor:
    """[T, H, D] queries of a windowed layer (this step's K/V already in the cache) -> [T, H, D]."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    plan = plan.on(q.device)
    out = torch.empty_like(q)
    if num_decodes:
        slots = plan.decode_slots
        keys = k_cache.index_select(0, slots.reshape(-1)).view(*slots.shape, kv_heads, dim).transpose(1, 2)
        values = v_cache.index_select(0, slots.reshape(-1)).view(*slots.shape, kv_heads, dim).transpose(1, 2)
        # [B, Hkv, G, D] queries: the mask of a decode is the same for its G heads.
        grouped = q[:num_decodes].view(num_decodes, kv_heads, heads // kv_heads, dim)
        attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=plan.decode_mask, scale=scale)
        out[:num_decodes] = attended.reshape(num_decodes, heads, dim)
    for chunk in plan.chunks:
        first, end = chunk.rows
        keys = k_cache.index_select(0, chunk.slots).transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, chunk.slots).transpose(0, 1).unsqueeze(0)
        queries = q[first:end].transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=chunk.mask, scale=scale,
                                                  enable_gqa=heads != kv_heads)
        out[first:end] = attended[0].transpose(0, 1)
    return out
