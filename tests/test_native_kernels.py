"""The native paged decode kernel (vlmd/layers/cpu/) against a float64 reference, in
every variant this host runs; one OpenMP runtime; a torch fallback where no library was
built."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys

import pytest
import torch

from vlmd.layers.attention import SequenceChunk, attention_backend_for
from vlmd.layers.cpu import library
from vlmd.layers.cpu import paged_decode as native_decode
from vlmd.layers.cpu.paged_decode import DecodeTables, paged_decode

needs_kernel = pytest.mark.skipif(not native_decode.available(), reason="no kernel library was built in this install")
pytestmark = pytest.mark.usefixtures("each_kernel_variant")


def _case(lengths, *, heads, kv_heads, dim, block_size, dtype=torch.float32, seed=0):
    """Random scattered block tables over one cache; returns (q, caches, tables, reference)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    needed = [-(-length // block_size) for length in lengths]
    num_blocks = sum(needed) + 5
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype)
    q = torch.randn(len(lengths), heads, dim).to(dtype)
    tables, expected = [], []
    scale = dim ** -0.5
    for row, (length, count) in enumerate(zip(lengths, needed)):
        table, pool = pool[:count], pool[count:]
        tables.append(table)
        expected.append(_reference(q[row], k_cache, v_cache, table, length, block_size, scale))
    return q, k_cache, v_cache, DecodeTables.of(tables, list(lengths), block_size), torch.stack(expected), scale


def _reference(query, k_cache, v_cache, table, length, block_size, scale):
    """One decode's [H, D] attention to its first ``length`` cached tokens, in float64."""
    heads, kv_heads = query.shape[0], k_cache.shape[1]
    positions = torch.arange(length)
    slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
    keys = k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
    values = v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("hd,lhd->hl", query.double(), keys) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(12, 4), (8, 8), (6, 1), (14, 2)])
@pytest.mark.parametrize("dim", [16, 40, 64, 128])
def test_gqa_and_head_sizes_match_the_reference(heads, kv_heads, dim):
    # 40 takes the generic (run-time head size) copy; the others their specialised ones.
    q, k, v, tables, expected, scale = _case([1, 17, 600, 33, 250], heads=heads, kv_heads=kv_heads, dim=dim,
                                             block_size=16, seed=dim + heads)
    torch.testing.assert_close(paged_decode(q, k, v, tables, scale).double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 5, 16, 64])
@pytest.mark.parametrize("part_tokens", [0, 16, 100])
def test_block_sizes_and_split_contexts(block_size, part_tokens):
    # Parts of a context merge exactly; a decode shorter than a part leaves empty parts.
    q, k, v, tables, expected, scale = _case([3, 130, 64, 700], heads=4, kv_heads=2, dim=32, block_size=block_size,
                                             seed=block_size)
    got = paged_decode(q, k, v, tables, scale, part_tokens=part_tokens)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_contexts_up_to_16k_tokens(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, tables, expected, scale = _case([16384, 4095, 9], heads=8, kv_heads=2, dim=64, block_size=16, seed=5)
        torch.testing.assert_close(paged_decode(q, k, v, tables, scale).double(), expected, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(previous)


@needs_kernel
def test_bfloat16_cache():
    q, k, v, tables, expected, scale = _case([200, 31], heads=4, kv_heads=2, dim=64, block_size=16,
                                             dtype=torch.bfloat16, seed=2)
    torch.testing.assert_close(paged_decode(q, k, v, tables, scale).double(), expected, rtol=2e-2, atol=2e-2)


@needs_kernel
def test_tables_the_cache_cannot_serve_raise_instead_of_reading_out_of_bounds():
    q, k, v, tables, _, scale = _case([40, 20], heads=4, kv_heads=2, dim=16, block_size=16)
    beyond = dataclasses.replace(tables, block_tables=tables.block_tables.clone())
    beyond.block_tables[1, 0] = k.shape[0] // 16  # one block past the cache
    with pytest.raises(ValueError, match="block id outside the cache"):
        paged_decode(q, k, v, beyond, scale)
    longer = dataclasses.replace(tables, context_lens=torch.tensor([40, 20 + 16 * 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="context length outside its block table"):
        paged_decode(q, k, v, longer, scale)


@needs_kernel
def test_the_backend_decodes_through_the_kernel_and_torch_mode_does_not(monkeypatch):
    calls = []
    real = native_decode.paged_decode
    monkeypatch.setattr(native_decode, "paged_decode", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    k_cache, v_cache = torch.randn(64, 2, 16), torch.randn(64, 2, 16)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    chunks = [SequenceChunk([0, 1], 20, 1), SequenceChunk([3], 5, 1)]
    outputs = {}
    for mode in ("auto", "torch"):
        backend = attention_backend_for("cpu", 16, mode)
        outputs[mode] = backend.forward(q, k, v, (k_cache, v_cache), backend.prepare_metadata(chunks, 2), 0.25)
    assert len(calls) == 1  # for "auto" only
    torch.testing.assert_close(outputs["auto"], outputs["torch"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention kernels"):
        attention_backend_for("cpu", 16, "fast")


@needs_kernel
def test_one_openmp_runtime_is_mapped_after_loading(each_kernel_variant):
    # The kernel's libgomp.so.1 must resolve to torch's: a second runtime would start a
    # second team of threads (docs/decisions.md D10, "One OpenMP team per process").
    code = (
        "import torch\n"
        "from vlmd.layers.cpu import paged_decode as n\n"
        "assert n.available()\n"
        "maps = open('/proc/self/maps').read().split()\n"
        "print(len({p for p in maps if 'libgomp' in p}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, library.ENV: each_kernel_variant})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "1", done.stdout  # (the last line: the load's log line comes first)


def test_no_library_means_torch_ops():
    # A source tree used without an install has no built library: the kernels report
    # themselves unavailable and the backend keeps torch's attention.
    try:
        library.use(None)
        assert not native_decode.available()
        assert attention_backend_for("cpu", 16, "auto").native_decode is False
    finally:
        library.reset()
    assert native_decode.available() == (library.load() is not None)


def _shared_case(groups, *, heads, kv_heads, dim, block_size, seed=0):
    """Decodes whose tables start with common blocks: ``groups`` is (shared blocks, [own
    tokens after them per decode]); returns (q, caches, tables, reference, scale)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = list(range(2048))
    rng.shuffle(pool)
    k_cache, v_cache = torch.randn(2048 * block_size, kv_heads, dim), torch.randn(2048 * block_size, kv_heads, dim)
    tables, lengths, shared = [], [], []
    for shared_blocks, own in groups:
        prefix, pool = pool[:shared_blocks], pool[shared_blocks:]
        rows = []
        for own_tokens in own:
            count = -(-own_tokens // block_size)
            table, pool = prefix + pool[:count], pool[count:]
            rows.append(len(tables))
            tables.append(table)
            lengths.append(shared_blocks * block_size + own_tokens)
        if len(rows) > 1 and shared_blocks:
            shared.append((rows, shared_blocks))
    q = torch.randn(len(tables), heads, dim)
    scale = dim ** -0.5
    expected = [_reference(q[row], k_cache, v_cache, table, length, block_size, scale)
                for row, (table, length) in enumerate(zip(tables, lengths))]
    return q, k_cache, v_cache, DecodeTables.of(tables, lengths, block_size, shared), torch.stack(expected), scale


@needs_kernel
# (10, 2, 64) and (6, 3, 96): KV heads whose queries are taken in batches of 3 and 2, and 2.
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 4, 64), (4, 2, 40), (96, 8, 32), (10, 2, 64), (6, 3, 96)])
@pytest.mark.parametrize("part_tokens", [0, 16, 50])
def test_decodes_sharing_a_prefix_read_it_once_for_all(heads, kv_heads, dim, part_tokens):
    # Two groups (one of 9: with 96 heads, two tiles of stacked queries), a decode of its
    # own, and a group whose members' own parts are one token.
    groups = [(38, [1, 5, 40, 17, 2, 9, 30, 16, 3]), (4, [1, 1]), (0, [300]), (20, [7, 12])]
    q, k, v, tables, expected, scale = _shared_case(groups, heads=heads, kv_heads=kv_heads, dim=dim, block_size=16,
                                                    seed=heads)
    assert tables.group_tokens.tolist() == [38 * 16, 4 * 16, 20 * 16]
    got = paged_decode(q, k, v, tables, scale, part_tokens=part_tokens)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
# Block sizes whose chunks are not whole tiles of the stacked path's tokens (4, 12), and
# query counts per KV head that leave a partial vector and a partial value batch (7 of 1
# KV head: 9 x 7 = 63 queries, 2 x 7 = 14, 5 x 7 = 35), of 3 or 6 rows (vectors of 8 or
# 16): with 5 x 5 = 25 and 5 x 7 = 35, every tail of 1-5 rows.
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 4, 64), (7, 1, 32), (10, 2, 16), (5, 1, 64)])
@pytest.mark.parametrize("block_size", [4, 12])
def test_stacked_queries_match_the_reference_at_any_block_size(heads, kv_heads, dim, block_size):
    groups = [(30, [1, 5, 20, 17, 2, 9, 3, 16, 3]), (3, [1, 2]), (4, [3, 8, 1, 6, 2])]
    q, k, v, tables, expected, scale = _shared_case(groups, heads=heads, kv_heads=kv_heads, dim=dim,
                                                    block_size=block_size, seed=dim)
    got = paged_decode(q, k, v, tables, scale)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_bad_groups_raise():
    q, k, v, tables, _, scale = _shared_case([(3, [5, 6])], heads=4, kv_heads=2, dim=16, block_size=16)
    for change in ({"group_tokens": torch.tensor([50], dtype=torch.int32)},  # not whole blocks
                   {"group_tokens": torch.tensor([16 * 9], dtype=torch.int32)},  # the whole context
                   {"group_members": torch.tensor([0, 0], dtype=torch.int32)}):  # a decode twice
        with pytest.raises(ValueError, match="shared-prefix group"):
            paged_decode(q, k, v, dataclasses.replace(tables, **change), scale)


@needs_kernel
def test_the_backend_hands_the_kernel_its_shared_prefixes():
    block_size = 16
    k_cache, v_cache = torch.randn(64 * block_size, 2, 16), torch.randn(64 * block_size, 2, 16)
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    prefix = list(range(10, 15))  # 80 tokens in common: above MIN_SHARED_TOKENS
    chunks = [SequenceChunk(prefix + [40], 85, 1), SequenceChunk(prefix + [41, 42], 100, 1),
              SequenceChunk([50, 51], 20, 1)]
    outputs = {}
    for mode in ("auto", "torch"):
        backend = attention_backend_for("cpu", block_size, mode)
        meta = backend.prepare_metadata(chunks, 3)
        outputs[mode] = backend.forward(q, k, v, (k_cache, v_cache), meta, 0.25)
    assert meta.decode_plan.shared and meta._decode_tables is None  # torch: the cascade plan
    auto_meta = attention_backend_for("cpu", block_size, "auto").prepare_metadata(chunks, 3)
    assert auto_meta.decode_tables.group_members.tolist() == [0, 1]
    assert auto_meta.decode_tables.group_tokens.tolist() == [80]
    torch.testing.assert_close(outputs["auto"], outputs["torch"], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("threshold,kernel_calls", [(2048, 1), (80, 0)])
def test_a_long_shared_prefix_keeps_the_torch_cascade(monkeypatch, threshold, kernel_calls):
    from vlmd.layers.attention import cpu_paged

    monkeypatch.setattr(cpu_paged, "NATIVE_SHARED_TOKENS", threshold)
    calls = []
    real = native_decode.paged_decode
    monkeypatch.setattr(native_decode, "paged_decode", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    k_cache, v_cache = torch.randn(64 * 16, 2, 16), torch.randn(64 * 16, 2, 16)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    prefix = list(range(10, 15))  # 80 shared tokens
    chunks = [SequenceChunk(prefix + [40], 85, 1), SequenceChunk(prefix + [41], 90, 1)]
    backend = attention_backend_for("cpu", 16, "auto")
    backend.forward(q, k, v, (k_cache, v_cache), backend.prepare_metadata(chunks, 2), 0.25)
    assert len(calls) == kernel_calls


def test_a_cuda_runner_never_builds_the_host_kernel(monkeypatch):
    monkeypatch.setattr(native_decode, "available", lambda: pytest.fail("the kernel was looked up for CUDA"))
    assert attention_backend_for("cuda:0", 16, "auto").name == "flex"  # D96: torch's own kernels
    assert attention_backend_for("cuda:0", 16, "torch").native_decode is False


@needs_kernel
def test_what_the_kernel_serves_follows_its_own_limits():
    assert native_decode.supports(torch.zeros(32, 2, 256), heads=128)
    assert not native_decode.supports(torch.zeros(32, 2, 264), heads=8)  # head size over the kernel's 256
    assert not native_decode.supports(torch.zeros(32, 2, 64), heads=130)  # more heads than its 128
    assert not native_decode.supports(torch.zeros(32, 2, 64, dtype=torch.float16), heads=8)
    assert not native_decode.supports(torch.zeros(32, 2, 64)[:, :, :32], heads=8)  # not contiguous
