"""CPU paged attention that reads K/V in place, through the block table.

Per sequence, the cached context is split into segments (``segments.py``): contiguous slot
ranges, which are views of the cache, and a few bounded gathers for scattered blocks. Each
segment is attended by torch's CPU flash-attention kernel, which also returns each query's
log-sum-exp; partial results are merged exactly (the log-sum-exp rule of online softmax).
No layer ever copies a whole context, which the previous gather did for every decode in
every layer (47 ms against 2.5 ms per layer at 16k tokens, measured with
contrib/bench/bench_attention.py).

- A decode's query attends to its whole cached context (its own K/V were just written),
  with no mask: order of the keys does not matter, which is what lets segments be sorted.
- A prefill chunk attends to its earlier context (no mask: every earlier token precedes
  every query) and, causally, to its own new tokens, taken straight from this step's k/v.
- Small decode batches (the padded copy of all their contexts fits in
  ``BATCHED_DECODE_BYTES``) still gather, into one padded ``[B, L]`` batch and one masked
  SDPA call: below that size a kernel call per sequence costs more than the copy (tiny
  models, short contexts; same benchmark).
- GQA: for an unmasked segment the ``G`` query heads sharing a key/value head are stacked
  as ``G * n`` queries of that head, so each K/V head is read once; the causal self part
  uses the kernel's own GQA support.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlmd.layers.attention.backend import AttentionBackend, AttentionMetadata, SequenceChunk, write_kv
from vlmd.layers.attention.segments import ContextSegments, context_segments

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# Decodes are gathered into one padded batch when that copy (K and V, one layer) is at most
# this many bytes (about the size of a core's L2), and read in place otherwise.
BATCHED_DECODE_BYTES = 1 << 20
# The padded index is only built when it could qualify (a K/V token is >= 2 * 4 bytes).
_BATCHED_DECODE_MAX_TOKENS = BATCHED_DECODE_BYTES // 8


@dataclass
class DecodeBatch:
    slots: torch.Tensor  # [B, L] context slots, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, L] True = attend


@dataclass
class SequencePlan:
    rows: tuple[int, int]  # [first, end) rows of the flattened batch
    context: ContextSegments  # the cached tokens it attends to without a mask
    causal_self: bool  # a prefill chunk: also attends causally to its own new tokens


@dataclass
class CPUPagedMetadata(AttentionMetadata):
    plans: list[SequencePlan]
    decode_batch: DecodeBatch | None  # the decodes as one padded batch, when small enough


class CPUPagedBackend(AttentionBackend):
    name = "cpu_paged"

    def prepare_metadata(self, chunks: list[SequenceChunk], num_decodes: int) -> CPUPagedMetadata:
        plans = []
        row = 0
        for index, chunk in enumerate(chunks):
            if index < num_decodes and (chunk.count != 1 or chunk.start == 0):
                raise ValueError("a decode is one new token after some context")
            decode = index < num_decodes
            # A decode's own token is in the cache by the time attention runs.
            context_length = chunk.start + 1 if decode else chunk.start
            plans.append(SequencePlan(
                rows=(row, row + chunk.count),
                context=context_segments(chunk.block_ids, context_length, self.block_size),
                causal_self=not decode,
            ))
            row += chunk.count
        return CPUPagedMetadata(
            backend=self, slot_mapping=self.slot_mapping(chunks), num_decodes=num_decodes, plans=plans,
            decode_batch=self._decode_batch(chunks[:num_decodes]),
        )

    def _decode_batch(self, decodes: list[SequenceChunk]) -> DecodeBatch | None:
        if not decodes:
            return None
        lengths = [chunk.start + 1 for chunk in decodes]
        longest = max(lengths)
        if longest * len(decodes) > _BATCHED_DECODE_MAX_TOKENS:
            return None
        size = self.block_size
        blocks = -(-longest // size)
        table = torch.tensor([c.block_ids[:blocks] + [0] * (blocks - len(c.block_ids[:blocks])) for c in decodes])
        slots = (table.unsqueeze(-1) * size + torch.arange(size)).view(len(decodes), -1)[:, :longest]
        mask = torch.arange(longest).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        return DecodeBatch(slots.contiguous(), mask.view(len(decodes), 1, 1, longest))

    def forward(self, q, k, v, kv_cache, meta: CPUPagedMetadata, scale: float) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        k_cache, v_cache = kv_cache
        heads, kv_heads = q.shape[1], k.shape[1]
        out = torch.empty_like(q)
        plans = meta.plans
        batch = meta.decode_batch
        if batch is not None and batch.slots.numel() * 2 * k_cache[0].numel() * k_cache.element_size() <= BATCHED_DECODE_BYTES:
            decodes = meta.num_decodes
            # [B, Hkv, G, D] queries against [B, Hkv, L, D]: the mask is the same for all G.
            grouped = q[:decodes].view(decodes, kv_heads, heads // kv_heads, q.shape[2])
            keys = k_cache[batch.slots].transpose(1, 2)
            values = v_cache[batch.slots].transpose(1, 2)
            attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=batch.mask, scale=scale)
            out[:decodes] = attended.reshape(decodes, heads, q.shape[2])
            plans = plans[decodes:]
        for plan in plans:
            first, end = plan.rows
            n = end - first
            # [H, n, D]; for unmasked segments seen as [1, Hkv, G * n, D] (GQA, see above).
            queries = q[first:end].transpose(0, 1).contiguous()
            grouped = queries.view(1, kv_heads, (heads // kv_heads) * n, q.shape[2])
            partial: tuple[torch.Tensor, torch.Tensor] | None = None
            if plan.causal_self and plan.context.count == 0:
                out[first:end] = _self_attention(queries, k[first:end], v[first:end], scale).transpose(0, 1)
                continue
            for start, stop in plan.context.views:
                partial = _merge(partial, _unmasked(grouped, k_cache[start:stop], v_cache[start:stop], scale, n))
            for slots in plan.context.gathers:
                partial = _merge(partial, _unmasked(grouped, k_cache[slots], v_cache[slots], scale, n))
            if plan.causal_self:
                self_out, self_lse = _flash(
                    queries.unsqueeze(0), _heads_first(k[first:end]), _heads_first(v[first:end]),
                    0.0, True, scale=scale,
                )
                partial = _merge(partial, (self_out.reshape(heads, n, -1), self_lse.reshape(heads, n)))
            out[first:end] = partial[0].transpose(0, 1)
        return out


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, Hkv, D] (a view of the cache or of this step's k/v) -> [1, Hkv, L, D], no copy."""
    return x.permute(1, 0, 2).unsqueeze(0)


def _unmasked(grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, n: int):
    """Attention of the grouped queries to one segment: ([H, n, D] output, [H, n] log-sum-exp)."""
    attended, lse = _flash(grouped, _heads_first(keys), _heads_first(values), 0.0, False, scale=scale)
    heads = attended.shape[1] * attended.shape[2] // n
    return attended.reshape(heads, n, -1), lse.reshape(heads, n)


def _self_attention(queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk with no earlier context: causal attention within it. [H, n, D] -> [H, n, D]."""
    attended = F.scaled_dot_product_attention(
        queries.unsqueeze(0), _heads_first(k), _heads_first(v),
        is_causal=True, scale=scale, enable_gqa=queries.shape[0] != k.shape[1],
    )
    return attended[0]


def _merge(acc, part):
    """Combine two softmax-attention partials over disjoint key sets, exactly."""
    if acc is None:
        return part
    out_a, lse_a = acc
    out_b, lse_b = part
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    # In float32 (the log-sum-exp's dtype) whatever the model's dtype.
    return out_a.float() * weight_a + out_b.float() * weight_b, lse
