"""The native prefill attention kernel (vlmd/layers/cpu/paged_prefill.c) against a
float64 reference, its checks, and when the CPU backend hands it a chunk."""

from __future__ import annotations

import pytest
import torch

from prefill_support import paged_case, reference
from vlmd.layers.attention import SequenceChunk
from vlmd.layers.attention.cpu_paged import CPUPagedBackend
from vlmd.layers.cpu import paged_prefill as native_prefill
from vlmd.layers.cpu.paged_prefill import paged_prefill

needs_kernel = pytest.mark.skipif(not native_prefill.available(), reason="no kernel library was built in this install")
pytestmark = pytest.mark.usefixtures("each_kernel_variant")


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,n,dim,start,block_size", [
    (12, 4, 600, 64, 0, 16),   # the small LLaVA's prompt
    (12, 4, 37, 64, 600, 16),  # a chunk after a cached image
    (6, 1, 50, 32, 13, 5),     # GQA 6:1, blocks of 5, a context ending mid-block
    (8, 8, 33, 64, 0, 16),
    (4, 2, 9, 16, 100, 1),     # one-token blocks
    (14, 2, 70, 32, 3, 64),
    (12, 4, 1, 64, 0, 16),     # a one-token prompt
    (4, 4, 5, 16, 3000, 16),   # a few queries against a long context
])
@pytest.mark.parametrize("causal", [True, False])
def test_chunks_match_the_reference(heads, kv_heads, n, dim, start, block_size, causal):
    q, k_cache, v_cache, table, keys, values = paged_case(heads, kv_heads, n, dim, start, block_size)
    out = torch.empty_like(q)
    paged_prefill(q, k_cache, v_cache, table, block_size, start, dim ** -0.5, out, causal)
    torch.testing.assert_close(out.double(), reference(q, keys, values, start, causal), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,n,dim,start,block_size", [
    (12, 4, 600, 64, 0, 16),
    (12, 4, 37, 64, 600, 16),
    (6, 1, 50, 32, 13, 5),
    (4, 2, 9, 16, 100, 1),
])
@pytest.mark.parametrize("causal", [True, False])
def test_bfloat16_caches_are_read_in_place(heads, kv_heads, n, dim, start, block_size, causal):
    """A bfloat16 cache (the dtype a user of an AVX512-BF16 or AMX host runs): the attention
    of the bfloat16 values, computed in float32, rounded once to bfloat16 at the end."""
    q, k_cache, v_cache, table, keys, values = paged_case(heads, kv_heads, n, dim, start, block_size)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    out = torch.empty_like(q)
    paged_prefill(q, k_cache, v_cache, table, block_size, start, dim ** -0.5, out, causal)
    expected = reference(q.float(), keys.bfloat16().float(), values.bfloat16().float(), start, causal)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected.bfloat16().double(), rtol=0, atol=1e-2)
    # Within float32 rounding before the one bfloat16 rounding: never a rounding step apart.
    assert (out.double() - expected).abs().max() <= expected.abs().max() * 2 ** -8 + 1e-6


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_strided_queries_and_thread_counts(threads):
    q, k_cache, v_cache, table, keys, values = paged_case(12, 4, 100, 64, 20, 16)
    fused = torch.randn(100, 12 + 8, 64)  # q as a view of a fused qkv output: tokens 20 heads apart
    fused[:, :12] = q
    out = torch.empty(100, 12, 64)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        paged_prefill(fused[:, :12], k_cache, v_cache, table, 16, 20, 0.125, out)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out.double(), reference(q, keys, values, 20, True), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_what_it_cannot_serve_raises_instead_of_reading_out_of_bounds():
    q, k_cache, v_cache, table, _, _ = paged_case(4, 2, 10, 16, 0, 16)
    out = torch.empty_like(q)
    outside = table.clone()
    outside[0] = k_cache.shape[0] // 16  # one past the last block
    with pytest.raises(ValueError, match="block id outside"):
        paged_prefill(q, k_cache, v_cache, outside, 16, 0, 0.25, out)
    with pytest.raises(ValueError, match="size"):  # a table too short for its tokens
        paged_prefill(q, k_cache, v_cache, table[:0], 16, 0, 0.25, out)
    with pytest.raises(ValueError, match="int32"):
        paged_prefill(q, k_cache, v_cache, table.long(), 16, 0, 0.25, out)
    assert native_prefill.supports(k_cache, q)
    assert not native_prefill.supports(k_cache.bfloat16(), q)  # queries and cache of one dtype
    assert native_prefill.supports(k_cache.bfloat16(), q.bfloat16())
    assert not native_prefill.supports(k_cache.half(), q.half())
    with pytest.raises(ValueError, match="one dtype"):
        paged_prefill(q, k_cache.bfloat16(), v_cache.bfloat16(), table, 16, 0, 0.25, out)
    assert not native_prefill.supports(torch.zeros(32, 2, 128), torch.zeros(1, 4, 128))  # no copy for 128


@needs_kernel
@pytest.mark.parametrize("kernels,expected_calls", [("auto", [7, 3]), ("torch", [])])
def test_the_backend_hands_prefill_chunks_to_the_kernel(monkeypatch, kernels, expected_calls):
    calls = []
    real = native_prefill.paged_prefill
    monkeypatch.setattr(native_prefill, "paged_prefill", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    torch.manual_seed(1)
    block_size, heads, kv_heads, dim = 4, 4, 2, 16
    k_cache = torch.zeros(64 * block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    backend = CPUPagedBackend(block_size, kernels)
    # A fresh 7-token prompt and a 3-token chunk after 5 cached tokens.
    chunks = [SequenceChunk([0, 1], 0, 7), SequenceChunk([2, 3], 5, 3)]
    cached = torch.randn(5, kv_heads, dim), torch.randn(5, kv_heads, dim)
    k_cache[8:13], v_cache[8:13] = cached
    meta = backend.prepare_metadata(chunks, 0)
    q, k, v = torch.randn(10, heads, dim), torch.randn(10, kv_heads, dim), torch.randn(10, kv_heads, dim)
    out = backend.forward(q, k, v, (k_cache, v_cache), meta, dim ** -0.5)
    assert calls == expected_calls
    keys = torch.cat([k[:7], cached[0], k[7:]]), torch.cat([v[:7], cached[1], v[7:]])
    for rows, key_rows, start in (((0, 7), (0, 7), 0), ((7, 10), (7, 15), 5)):
        ks = keys[0][key_rows[0]:key_rows[1]].transpose(0, 1).repeat_interleave(2, 0)
        vs = keys[1][key_rows[0]:key_rows[1]].transpose(0, 1).repeat_interleave(2, 0)
        expected = reference(q[rows[0]:rows[1]], ks, vs, start, True)
        torch.testing.assert_close(out[rows[0]:rows[1]].double(), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_chunk_past_the_key_bound_takes_the_torch_path(monkeypatch):
    """Past ``NATIVE_PREFILL_MAX_KEYS`` keys the kernel is slower than torch's flash
    (``contrib/bench/bench_prefill_attention.py``): such a chunk is not handed to it, and the
    answer is the same."""
    from vlmd.layers.attention import cpu_paged

    calls = []
    real = native_prefill.paged_prefill
    monkeypatch.setattr(native_prefill, "paged_prefill", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(cpu_paged, "NATIVE_PREFILL_MAX_KEYS", 12)
    torch.manual_seed(2)
    block_size, heads, kv_heads, dim = 4, 4, 2, 16
    k_cache = torch.randn(16 * block_size, kv_heads, dim)
    v_cache = torch.randn_like(k_cache)
    backend = CPUPagedBackend(block_size, "auto")
    # 12 keys: the kernel's; 5 cached + 8 new = 13 keys: torch's.
    chunks = [SequenceChunk([0, 1, 2], 0, 12), SequenceChunk([4, 5, 6, 7], 5, 8)]
    meta = backend.prepare_metadata(chunks, 0)
    q, k, v = torch.randn(20, heads, dim), torch.randn(20, kv_heads, dim), torch.randn(20, kv_heads, dim)
    out = backend.forward(q, k, v, (k_cache, v_cache), meta, dim ** -0.5)
    assert calls == [12]
    torch_backend = CPUPagedBackend(block_size, "torch")
    expected = torch_backend.forward(q, k, v, (k_cache, v_cache), torch_backend.prepare_metadata(chunks, 0), dim ** -0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
