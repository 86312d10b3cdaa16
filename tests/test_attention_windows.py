"""Sliding-window layers and bidirectional spans on the CPU paged backend, against a plain
reference: every sequence's whole K/V, a mask built position by position, float64 softmax.

Random block tables, chunked prefill (a step's chunk after cached context), decodes,
windows smaller and larger than a block, spans crossing block borders, GQA; both the
native (``auto``) and the torch-only backends."""

from __future__ import annotations

import pytest
import torch

from vlmd.layers.attention import SequenceChunk, paged_attention
from vlmd.layers.attention.cpu_paged import CPUPagedBackend

HEADS, KV_HEADS, DIM = 4, 2, 16


def _reference(q_rows, keys, values, positions, spans, window):
    """[n, H, D] queries at ``positions`` against a sequence's [L, Hkv, D] keys: the mask
    written out as the rule reads (causal or in one span, and within the window)."""
    length = keys.shape[0]
    span_of = [next((index for index, (a, b) in enumerate(spans) if a <= p < b), None) for p in range(length)]
    mask = torch.tensor([[(key <= query or (span_of[key] is not None and span_of[key] == span_of[query]))
                          and (window is None or key > query - window) for key in range(length)]
                         for query in positions])
    group = HEADS // KV_HEADS
    k = keys.double().repeat_interleave(group, 1)  # [L, H, D]
    v = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q_rows.double(), k) * DIM ** -0.5
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", weights, v)


class Sequences:
    """Sequences with scattered blocks in one cache, their whole K/V kept aside."""

    def __init__(self, lengths, block_size, seed):
        self.generator = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        needed = [-(-length // block_size) for length in lengths]
        order = torch.randperm(sum(needed) + 3, generator=self.generator).tolist()
        self.tables = []
        for count in needed:
            self.tables.append(order[:count])
            order = order[count:]
        slots = (sum(needed) + 3) * block_size
        self.cache = (torch.zeros(slots, KV_HEADS, DIM), torch.zeros(slots, KV_HEADS, DIM))
        self.keys = [torch.randn(length, KV_HEADS, DIM, generator=self.generator) for length in lengths]
        self.values = [torch.randn(length, KV_HEADS, DIM, generator=self.generator) for length in lengths]
        self.queries = [torch.randn(length, HEADS, DIM, generator=self.generator) for length in lengths]

    def step(self, backend, pieces, spans, window):
        """Run one step of ``pieces`` (sequence, start, count), decodes first; check every row."""
        chunks = [SequenceChunk(self.tables[seq], start, count, tuple(spans.get(seq, ())))
                  for seq, start, count in pieces]
        num_decodes = sum(1 for _, start, count in pieces if count == 1 and start > 0)
        meta = backend.prepare_metadata(chunks, num_decodes)
        q = torch.cat([self.queries[seq][start:start + count] for seq, start, count in pieces])
        k = torch.cat([self.keys[seq][start:start + count] for seq, start, count in pieces])
        v = torch.cat([self.values[seq][start:start + count] for seq, start, count in pieces])
        out = paged_attention(q, k, v, self.cache, meta, DIM ** -0.5, window)
        row = 0
        for seq, start, count in pieces:
            end = start + count
            expected = _reference(self.queries[seq][start:end], self.keys[seq][:end], self.values[seq][:end],
                                  list(range(start, end)), spans.get(seq, ()), window)
            torch.testing.assert_close(out[row:row + count].double(), expected, atol=1e-4, rtol=1e-4)
            row += count


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("window", [None, 3, 11, 40])
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_then_decodes_match_the_reference(kernels, window, block_size):
    """Three sequences prefilled in chunks (spans crossing block borders, one at the start,
    one cut by no chunk), then decoded together, step by step."""
    backend = CPUPagedBackend(block_size, kernels)
    lengths = [40, 33, 26]
    sequences = Sequences(lengths, block_size, seed=block_size + (window or 0))
    spans = {0: [(5, 14), (20, 27)], 1: [(0, 9)], 2: []}
    prompt = [34, 30, 20]
    # Chunks that never cut a span: [0, 14) [14, 34); [0, 12) [12, 30); [0, 7) [7, 20).
    sequences.step(backend, [(0, 0, 14), (1, 0, 12), (2, 0, 7)], spans, window)
    sequences.step(backend, [(0, 14, 20), (1, 12, 18), (2, 7, 13)], spans, window)
    for offset in range(6):
        pieces = [(seq, prompt[seq] + offset, 1) for seq in range(3) if prompt[seq] + offset < lengths[seq]]
        sequences.step(backend, pieces, spans, window)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("window", [None, 5, 64])
def test_a_step_mixing_decodes_and_long_chunks(kernels, window):
    """Decodes of different lengths (a window padded across them) beside a prefill chunk
    after a long cached context, whose span starts the chunk."""
    block_size = 8
    backend = CPUPagedBackend(block_size, kernels)
    sequences = Sequences([150, 9, 70], block_size, seed=7)
    spans = {0: [(100, 130)], 2: [(2, 40)]}
    sequences.step(backend, [(0, 0, 100), (1, 0, 8), (2, 0, 60)], spans, window)
    sequences.step(backend, [(1, 8, 1), (2, 60, 1), (0, 100, 50)], spans, window)


def test_a_prefix_hit_inside_a_span_reads_the_cached_part():
    """A chunk that starts inside a span (its first part was cached by a request with the
    same image) attends to the whole span from every query in the chunk."""
    backend = CPUPagedBackend(4, "torch")
    sequences = Sequences([30], 4, seed=3)
    spans = {0: [(6, 20)]}
    sequences.step(backend, [(0, 0, 12)], {0: [(6, 12)]}, None)  # the cached part, as its own span
    sequences.step(backend, [(0, 12, 18)], spans, None)  # queries of the span's rest


@pytest.mark.parametrize("window", [None, 4])
def test_a_chunk_cutting_a_span_is_refused(window):
    backend = CPUPagedBackend(4, "torch")
    with pytest.raises(ValueError, match="one step"):
        backend.prepare_metadata([SequenceChunk([0, 1, 2], 0, 8, ((5, 10),))], 0)
    with pytest.raises(ValueError, match="empty"):
        backend.prepare_metadata([SequenceChunk([0, 1, 2], 0, 8, ((5, 5),))], 0)


def test_a_window_below_one_token_is_refused():
    backend = CPUPagedBackend(4, "torch")
    sequences = Sequences([8], 4, seed=1)
    with pytest.raises(ValueError, match="window"):
        sequences.step(backend, [(0, 0, 8)], {}, 0)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("window", [3, 11])
def test_a_window_group_reads_and_writes_its_own_table_and_cache(kernels, window):
    """A windowed layer whose sequences have tables of their own (a window group of the KV model):
    K/V go to its own small cache through those tables; blocks the window left behind are
    FREED and handed to other sequences at once (so a read of one would see other keys),
    and every row still equals the reference. The main tables' cache is never touched."""
    from vlmd.layers.attention import LayerCache
    from vlmd.sched.kv_managers import FREED
    from vlmd.sched.kv_spec import first_visible_block

    block_size = 4
    backend = CPUPagedBackend(block_size, kernels)
    lengths = [40, 33, 26]
    sequences = Sequences(lengths, block_size, seed=window)
    free = list(range(3 * (-(-(window + 20) // block_size) + 2)))
    own = (torch.zeros(len(free) * block_size, KV_HEADS, DIM), torch.zeros(len(free) * block_size, KV_HEADS, DIM))
    tables: list[list[int]] = [[] for _ in lengths]
    spans = {0: [(5, 14), (20, 27)], 1: [(0, 9)]}

    def step(pieces):
        for seq, start, _ in pieces:  # the scheduler's order: give back, then allocate
            for index in range(min(first_visible_block(start, window, block_size), len(tables[seq]))):
                if tables[seq][index] != FREED:
                    free.append(tables[seq][index])
                    tables[seq][index] = FREED
        for seq, start, count in pieces:
            while len(tables[seq]) * block_size < start + count:
                tables[seq].append(free.pop(0))
        chunks = [SequenceChunk(sequences.tables[seq], start, count, tuple(spans.get(seq, ())),
                                {0: sequences.tables[seq], 1: list(tables[seq])}) for seq, start, count in pieces]
        meta = backend.prepare_metadata(chunks, sum(1 for _, start, count in pieces if count == 1 and start > 0))
        q, k, v = ([torch.cat([part[seq][start:start + count] for seq, start, count in pieces])
                    for part in (sequences.queries, sequences.keys, sequences.values)])
        out = paged_attention(q, k, v, LayerCache(*own, 1), meta, DIM ** -0.5, window)
        row = 0
        for seq, start, count in pieces:
            expected = _reference(sequences.queries[seq][start:start + count], sequences.keys[seq][:start + count],
                                  sequences.values[seq][:start + count], list(range(start, start + count)),
                                  spans.get(seq, ()), window)
            torch.testing.assert_close(out[row:row + count].double(), expected, atol=1e-4, rtol=1e-4)
            row += count

    step([(0, 0, 14), (1, 0, 12), (2, 0, 7)])
    step([(0, 14, 20), (1, 12, 18), (2, 7, 13)])
    for position in range(6):
        step([(seq, start + position, 1) for seq, start in enumerate([34, 30, 20]) if start + position < lengths[seq]])
    assert FREED in tables[0] and not sequences.cache[0].any()
