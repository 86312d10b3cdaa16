"""The CPU paged attention backend against a plain dense reference.

Each case builds random block tables over a shared cache, writes earlier context into it,
runs one step of decodes and prefill chunks through ``prepare_metadata`` + ``forward``,
and compares with softmax(q k^T) v over each sequence's full, causally masked K/V in
float64.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from vlmd.layers.attention import SequenceChunk, attention_backend_for, cpu_paged, decode_plan, paged_attention
from vlmd.layers.attention.segments import GATHER_CHUNK_TOKENS, slot_ranges
from vlmd.layers.cpu import paged_decode as native_decode

HEAD_DIM = 8
KERNELS = "torch"  # set per case by the decode_path fixture


@pytest.fixture(params=["native", "in_place", "batched"], autouse=True)
def decode_path(request, monkeypatch):
    """Every case three ways: decodes through the native kernel, and through the torch
    path read in place or (small decode batches) as one padded gather."""
    if request.param == "native" and not native_decode.available():
        pytest.skip("no kernel library was built in this install")
    budget = 0 if request.param == "in_place" else 1 << 40
    monkeypatch.setattr(cpu_paged, "BATCHED_DECODE_BYTES", budget)
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", "auto" if request.param == "native" else "torch")
    return request.param


def _reference(q, keys, values, start, scale):
    """q [n, H, D] at positions start.., keys/values [start + n, Hkv, D]."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    keys = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    values = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), keys) * scale
    query_positions = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(keys.shape[0]).unsqueeze(0) > query_positions, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values)


def _run_step(seqs, *, heads=4, kv_heads=2, block_size=16, table_order="random", seed=0, dtype=torch.float32):
    """``seqs``: (context length, new tokens) per sequence, decodes (new = 1) first."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    needed = [-(-(start + count) // block_size) for start, count in seqs]
    num_blocks = sum(needed) + 3
    pool = list(range(num_blocks))
    if table_order == "random":
        rng.shuffle(pool)
    elif table_order == "descending":
        pool.reverse()
    cache = (torch.zeros(num_blocks * block_size, kv_heads, HEAD_DIM, dtype=dtype),
             torch.zeros(num_blocks * block_size, kv_heads, HEAD_DIM, dtype=dtype))
    chunks, contexts = [], []
    for (start, count), blocks in zip(seqs, needed):
        table, pool = pool[:blocks], pool[blocks:]
        k_ctx, v_ctx = torch.randn(start, kv_heads, HEAD_DIM).to(dtype), torch.randn(start, kv_heads, HEAD_DIM).to(dtype)
        positions = torch.arange(start)
        slots = torch.tensor(table, dtype=torch.long)[positions // block_size] * block_size + positions % block_size
        cache[0][slots], cache[1][slots] = k_ctx, v_ctx
        chunks.append(SequenceChunk(table, start, count))
        contexts.append((k_ctx, v_ctx))
    total = sum(count for _, count in seqs)
    q = torch.randn(total, heads, HEAD_DIM).to(dtype)
    k = torch.randn(total, kv_heads, HEAD_DIM).to(dtype)
    v = torch.randn(total, kv_heads, HEAD_DIM).to(dtype)
    backend = attention_backend_for("cpu", block_size, KERNELS)
    assert backend.native_decode is (KERNELS == "auto")
    num_decodes = sum(1 for start, count in seqs if count == 1 and start > 0)
    meta = backend.prepare_metadata(chunks, num_decodes)
    scale = HEAD_DIM**-0.5
    got = paged_attention(q, k, v, cache, meta, scale)
    row = 0
    for (start, count), (k_ctx, v_ctx) in zip(seqs, contexts):
        rows = slice(row, row + count)
        expected = _reference(q[rows], torch.cat([k_ctx, k[rows]]), torch.cat([v_ctx, v[rows]]), start, scale)
        tolerance = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got[rows].double(), expected, rtol=tolerance, atol=tolerance,
                                   msg=lambda m: f"sequence (context {start}, new {count}): {m}")
        row += count
    return meta


@pytest.mark.parametrize("order", ["random", "ascending", "descending"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_mixed_step_of_decodes_and_chunked_prefills(order, heads, kv_heads):
    seqs = [(1, 1), (37, 1), (600, 1), (16, 1), (0, 23), (45, 19), (64, 64), (3, 1 + 0)]
    seqs[-1] = (300, 5)  # a chunked prefill with a long earlier context
    _run_step(seqs, heads=heads, kv_heads=kv_heads, table_order=order, seed=hash(order) % 100)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_block_sizes_and_partly_used_blocks(block_size):
    _run_step([(5, 1), (block_size * 3, 1), (block_size * 3 - 1, 1), (block_size + 1, 7), (0, 2 * block_size + 3)],
              block_size=block_size, seed=block_size)


@pytest.mark.parametrize("order", ["random", "ascending"])
def test_contexts_up_to_16k_tokens(order):
    # A random table is all scattered blocks: gathered a bounded chunk at a time.
    meta = _run_step([(16383, 1), (4095, 1), (8000, 48)], heads=2, kv_heads=1, table_order=order, seed=7)
    context = meta.plans[0].context  # the prefill's earlier 8000 tokens
    assert all(len(slots) <= GATHER_CHUNK_TOKENS for slots in context.gathers)
    plan = meta.decode_plan
    assert all(len(slots) <= GATHER_CHUNK_TOKENS for _, slots in plan.gathers)
    if order == "ascending":
        # One run of blocks each, the last block (its own token's) included: one call each.
        assert [(row, end - start) for row, start, end in plan.views] == [(0, 16384), (1, 4096)]
        assert not plan.gathers and not plan.shared and not plan.leftover_rows
    else:
        assert plan.leftover_slots.shape[1] <= decode_plan.MAX_LEFTOVER_TOKENS


@pytest.mark.parametrize("order,in_one_view", [("ascending", True), ("random", False), ("descending", False)])
def test_a_lone_decode_is_read_in_place_only_when_its_context_is_one_run(order, in_one_view):
    # Otherwise (where the copy fits) it is gathered into one call: no parts to merge.
    meta = _run_step([(600, 1)], table_order=order, seed=11)
    assert meta.lone_decode_in_one_view is in_one_view
    assert meta.decode_batch.mask is None  # one decode: nothing padded


def test_bfloat16_cache():
    _run_step([(200, 1), (30, 9)], dtype=torch.bfloat16, seed=3)


def test_slot_ranges_merge_consecutive_blocks_in_any_order():
    assert slot_ranges([3, 4, 5], 48, 16) == [(48, 96)]
    assert slot_ranges([5, 4, 3], 40, 16) == [(64, 96), (48, 56)]  # tail block 3 is below 4
    assert slot_ranges([2, 3, 9], 40, 16) == [(32, 64), (144, 152)]
    assert slot_ranges([2, 3], 30, 16) == [(32, 62)]
    assert slot_ranges([7], 0, 16) == []
    with pytest.raises(ValueError, match="cannot hold"):
        slot_ranges([1], 17, 16)


def test_bad_batches_raise():
    backend = attention_backend_for("cpu:0", 16)
    with pytest.raises(ValueError, match="decode"):
        backend.prepare_metadata([SequenceChunk([0], 0, 1)], num_decodes=1)
    with pytest.raises(ValueError, match="cannot hold"):
        backend.prepare_metadata([SequenceChunk([0], 10, 10)], num_decodes=0)
    with pytest.raises(ValueError, match="no attention backend"):
        attention_backend_for("tpu", 16)


def _run_shared_step(groups, *, heads=6, kv_heads=2, block_size=16, seed=0):
    """Decodes whose tables start with common blocks, as the prefix cache hands them out.

    ``groups``: (shared prefix tokens, [own tokens after it per decode]); the prefix is a
    whole number of blocks written once, each decode's own blocks are scattered.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = list(range(4096))
    rng.shuffle(pool)
    cache = (torch.zeros(4096 * block_size, kv_heads, HEAD_DIM), torch.zeros(4096 * block_size, kv_heads, HEAD_DIM))

    def take(tokens):
        nonlocal pool
        count = -(-tokens // block_size)
        table, pool = pool[:count], pool[count:]
        return table

    def write(table, offset, k_ctx, v_ctx):
        positions = torch.arange(offset, offset + k_ctx.shape[0])
        slots = torch.tensor(table, dtype=torch.long)[positions // block_size] * block_size + positions % block_size
        cache[0][slots], cache[1][slots] = k_ctx, v_ctx

    chunks, contexts = [], []
    for prefix_tokens, own in groups:
        prefix_table = sorted(take(prefix_tokens))  # a prefill's blocks: one ascending run
        prefix_k, prefix_v = torch.randn(prefix_tokens, kv_heads, HEAD_DIM), torch.randn(prefix_tokens, kv_heads, HEAD_DIM)
        write(prefix_table, 0, prefix_k, prefix_v)
        for own_tokens in own:
            table = prefix_table + take(own_tokens + 1)
            k_own, v_own = torch.randn(own_tokens, kv_heads, HEAD_DIM), torch.randn(own_tokens, kv_heads, HEAD_DIM)
            write(table, prefix_tokens, k_own, v_own)
            chunks.append(SequenceChunk(table, prefix_tokens + own_tokens, 1))
            contexts.append((torch.cat([prefix_k, k_own]), torch.cat([prefix_v, v_own])))
    q = torch.randn(len(chunks), heads, HEAD_DIM)
    k = torch.randn(len(chunks), kv_heads, HEAD_DIM)
    v = torch.randn(len(chunks), kv_heads, HEAD_DIM)
    meta = attention_backend_for("cpu", block_size, KERNELS).prepare_metadata(chunks, len(chunks))
    scale = HEAD_DIM**-0.5
    got = paged_attention(q, k, v, cache, meta, scale)
    for row, (chunk, (k_ctx, v_ctx)) in enumerate(zip(chunks, contexts)):
        expected = _reference(q[row:row + 1], torch.cat([k_ctx, k[row:row + 1]]), torch.cat([v_ctx, v[row:row + 1]]),
                              chunk.start, scale)
        torch.testing.assert_close(got[row:row + 1].double(), expected, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"decode {row} (context {chunk.start}): {m}")
    return meta


def test_decodes_sharing_prefix_blocks_read_them_once(decode_path):
    # Two images' prompts (3 and 2 requests each), a lone request, one sharing too little.
    meta = _run_shared_step([(608, [0, 5, 40]), (320, [17, 33]), (48, [3, 9]), (0, [700])], seed=4)
    # Even where the padded batch would fit, sharing decodes take the plan (the batch would
    # copy the shared blocks once per decode).
    assert meta.decodes_share_a_prefix
    assert meta._decode_batch is None  # the padded batch it does not take is never built
    shared = sorted((prefix.rows, sum(end - start for start, end in prefix.ranges)) for prefix in meta.decode_plan.shared)
    # The 48-token prefix is below MIN_SHARED_TOKENS: those two decode on their own.
    assert shared == [([0, 1, 2], 608), ([3, 4], 320)]


def test_shared_groups_split_where_tables_diverge():
    full = [40, 40, 40, 40, 2]
    tables = [
        list(range(40)),
        list(range(40)),
        [0] + list(range(100, 139)),  # one block in common with rows 0-1: too few
        [0] + list(range(100, 139)),
        [0, 1, 2],
    ]
    groups = decode_plan.shared_groups(tables, full, list(range(5)), 0, 16)
    assert sorted(groups) == [([0, 1], 40), ([2, 3], 40)]


def test_a_last_block_after_its_run_is_read_in_place_and_other_tails_are_batched():
    # Tables of 5 blocks: the first 4 are one run (64 tokens, a view), the 5th is the tail.
    plan = decode_plan.plan_decodes([[0, 1, 2, 3, 9], [4, 5, 6, 7, 8]], [65, 80], 16)
    assert not plan.shared  # different blocks
    # Row 1's tail (block 8) follows its run (blocks 4-7): the view covers it.
    assert plan.views == [(0, 0, 64), (1, 64, 144)]
    assert plan.leftover_rows == [0]
    assert plan.leftover_slots.tolist() == [[9 * 16]] and plan.leftover_valid.sum().item() == 1
