"""The bfloat16 decode scores by AVX512-BF16 (``attend_part_dot`` in vlmd/layers/cpu/paged_decode.c)
against a float64 reference of the same arithmetic (the query rounded to bfloat16, the
cache's own values), at every head size it serves, GQA ratio, block size, split, window and
beside a shared prefix's stacked queries; the widening path it replaces, still taken
when switched off; and that the host turns each AVX512-BF16 kernel on where it can
(``bfloat16.h``)."""

from __future__ import annotations

import random

import pytest
import torch

from vlmd.layers.cpu import paged_decode as native_decode
from vlmd.layers.cpu.paged_decode import DecodeTables, paged_decode


@pytest.fixture
def dot(each_kernel_variant):
    """Each kernel variant in turn with the dot scores on; skipped where it (or the host) has
    no AVX512-BF16."""
    if not native_decode.available():
        pytest.skip("no kernel library was built in this install")
    previous = native_decode.bf16_dot_scores()
    if not native_decode.bf16_dot_scores(True):
        pytest.skip(f"the {each_kernel_variant} kernels on this host have no AVX512-BF16 decode scores")
    try:
        yield
    finally:
        native_decode.bf16_dot_scores(previous)


def _case(lengths, *, heads, kv_heads, dim, block_size, shared=(), seed=0):
    """float32 queries, bfloat16 caches, scattered tables; ``shared``: (rows, blocks) groups
    whose rows' tables start with the same blocks."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    needed = [-(-length // block_size) for length in lengths]
    pool = list(range(sum(needed) + 5))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(count)] for count in needed]
    for rows, blocks in shared:
        for row in rows[1:]:
            tables[row][:blocks] = tables[rows[0]][:blocks]
    slots = (len(needed) + sum(needed) + 5) * block_size
    k_cache = torch.randn(slots, kv_heads, dim).bfloat16()
    v_cache = torch.randn(slots, kv_heads, dim).bfloat16()
    q = torch.randn(len(lengths), heads, dim) * 2  # scores of a few units: softmax not flat
    return q, k_cache, v_cache, DecodeTables.of(tables, list(lengths), block_size, list(shared)), dim ** -0.5


def _reference(q, k_cache, v_cache, tables, scale, *, round_query, window=None):
    """[B, H, D] in float64: each decode against its tokens (its last ``window``), the query
    rounded to bfloat16 first where ``round_query`` (after scaling, as the kernel rounds it)."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = []
    for row in range(q.shape[0]):
        length, block_size = int(tables.context_lens[row]), tables.block_size
        positions = torch.arange(max(0, length - window) if window else 0, length)
        slots = tables.block_tables[row][positions // block_size].long() * block_size + positions % block_size
        keys = k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        values = v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        query = q[row] * scale
        query = query.bfloat16().double() if round_query else query.double()
        scores = torch.einsum("hd,lhd->hl", query, keys)
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values))
    return torch.stack(out)


CASES = [  # heads, kv_heads, dim, lengths, block_size
    (12, 4, 64, [1, 17, 620, 33, 250, 16, 15], 16),  # the small LLaVA's heads; whole, odd, one-token chunks
    (8, 8, 32, [40, 3, 129], 5),                     # one query a KV head; chunks cut by blocks of 5
    (6, 1, 128, [300, 16, 2], 16),                   # 6:1 GQA, 128-wide heads
    (14, 2, 256, [70, 2], 1),                        # the widest head, one-token blocks
    (4, 2, 64, [700, 65], 64),                       # blocks of 64: four chunks a block
]


@pytest.mark.usefixtures("dot")
@pytest.mark.parametrize("heads,kv_heads,dim,lengths,block_size", CASES)
@pytest.mark.parametrize("part_tokens", [0, 32, 100])
def test_dot_scores_match_the_rounded_query_reference(heads, kv_heads, dim, lengths, block_size, part_tokens):
    q, k, v, tables, scale = _case(lengths, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size,
                                   seed=dim + heads)
    got = paged_decode(q, k, v, tables, scale, part_tokens=part_tokens).double()
    torch.testing.assert_close(got, _reference(q, k, v, tables, scale, round_query=True), rtol=2e-5, atol=2e-5)


@pytest.mark.usefixtures("dot")
def test_the_switch_picks_the_kernel():
    # Off, the widening path multiplies the unrounded query: each path matches its own
    # reference and not the other's (the rounding moves outputs by ~1e-3 here).
    q, k, v, tables, scale = _case([300, 45], heads=12, kv_heads=4, dim=64, block_size=16, seed=3)
    rounded = _reference(q, k, v, tables, scale, round_query=True)
    exact = _reference(q, k, v, tables, scale, round_query=False)
    assert (rounded - exact).abs().max() > 1e-4
    native_decode.bf16_dot_scores(False)
    widened = paged_decode(q, k, v, tables, scale).double()
    torch.testing.assert_close(widened, exact, rtol=1e-5, atol=1e-5)
    assert native_decode.bf16_dot_scores(True)
    dotted = paged_decode(q, k, v, tables, scale).double()
    torch.testing.assert_close(dotted, rounded, rtol=2e-5, atol=2e-5)
    assert (dotted - exact).abs().max() > 1e-4


@pytest.mark.usefixtures("dot")
@pytest.mark.parametrize("window", [1, 16, 37])
def test_a_window_reads_its_last_tokens(window):
    q, k, v, tables, scale = _case([100, 20, 37, 5], heads=12, kv_heads=4, dim=64, block_size=16, seed=window)
    got = paged_decode(q, k, v, tables, scale, window=window).double()
    expected = _reference(q, k, v, tables, scale, round_query=True, window=window)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.usefixtures("dot")
# 24 queries a KV head (a vector and a half of 16), 7 (one partial vector), 30 of 64-wide
# heads in two tiles of stacked decodes (96 heads: 2 decodes a tile); blocks of 16, 4 and 12.
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,rows", [(12, 4, 64, 16, 8), (7, 1, 32, 4, 3),
                                                                (10, 2, 64, 12, 6), (96, 8, 128, 16, 3)])
def test_stacked_decodes_on_a_shared_prefix(heads, kv_heads, dim, block_size, rows):
    # The prefix is read once for the stacked queries of its decodes (attend_stacked, its
    # scores by stacked_scores_dot), each decode's own tokens by attend_part_dot; a decode
    # of its own beside them.
    blocks = 96 // block_size
    lengths = [blocks * block_size + 1 + 7 * i for i in range(rows)] + [40]
    q, k, v, tables, scale = _case(lengths, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size,
                                   shared=[(list(range(rows)), blocks)], seed=heads + dim)
    assert tables.group_tokens.tolist() == [blocks * block_size]
    got = paged_decode(q, k, v, tables, scale).double()
    torch.testing.assert_close(got, _reference(q, k, v, tables, scale, round_query=True), rtol=2e-5, atol=2e-5)


def test_the_host_turns_each_bfloat16_kernel_on_where_it_can(each_kernel_variant):
    # A fresh process, so no test's setting lingers: each AVX512-BF16 kernel's switch starts
    # on exactly where the loaded variant has AVX-512 and the CPU lists avx512_bf16 (a host
    # check that always said no would only turn the other tests into skips).
    import subprocess
    import sys

    from vlmd.layers.cpu import library, variants

    if each_kernel_variant == "none":
        pytest.skip("no kernel library was built in this install")
    expected = "avx512_bf16" in variants.cpu_flags() and each_kernel_variant == "x86-64-v4"
    code = ("from vlmd.layers.cpu import library, packed_linear, paged_decode, flash_bf16\n"
            f"library.use({each_kernel_variant!r})\n"
            "print(packed_linear.bf16_dot_products(), paged_decode.bf16_dot_scores(), flash_bf16.serves(64))")
    answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    last_line = answer.stdout.strip().splitlines()[-1]  # after the library's log line
    assert last_line.split() == [str(expected)] * 3, (answer.stdout, answer.stderr[-2000:])
    assert library.built_variants()  # the variant under test was built here
