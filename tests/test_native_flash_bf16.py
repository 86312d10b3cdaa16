"""The bfloat16 attention kernel (vlmd/layers/cpu/flash_bf16.c) against a float64 reference
and torch's own bfloat16 attention, its checks, when the CPU backend hands it a prefill
chunk, and the vision towers' ``"vlmd"`` attention implementation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefill_support import paged_case, reference
from vlmd.layers.attention import SequenceChunk
from vlmd.layers.attention import cpu_paged
from vlmd.layers.attention.cpu_paged import CPUPagedBackend
from vlmd.layers.attention.towers import TOWER_ATTENTION, tower_attention
from vlmd.layers.cpu import flash_bf16
from vlmd.layers.cpu.flash_bf16 import flash_bf16 as attend



@pytest.fixture
def served(each_kernel_variant):
    """Each kernel variant in turn; skipped where it (or the host) has no AVX512-BF16."""
    if not flash_bf16.serves(64):
        pytest.skip(f"the {each_kernel_variant} kernels on this host have no AVX512-BF16 attention")


def _case(heads, kv_heads, n, dim, start, block_size, seed=0):
    """``paged_case`` in bfloat16 (keys and values: the caches' own rounded values)."""
    q, k_cache, v_cache, table, keys, values = paged_case(heads, kv_heads, n, dim, start, block_size, seed)
    return q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), table, keys.bfloat16(), values.bfloat16()


@pytest.mark.usefixtures("served")
@pytest.mark.parametrize("heads,kv_heads,n,dim,start,block_size", [
    (12, 4, 587, 64, 0, 16),    # the small LLaVA's prompt
    (12, 4, 37, 64, 600, 16),   # a chunk after a cached image
    (6, 1, 50, 32, 13, 5),      # GQA 6:1, blocks of 5, a context ending mid-block
    (8, 8, 33, 64, 0, 16),      # a tile and one row
    (4, 2, 100, 128, 1000, 16),  # 128-wide heads after a long context
    (2, 2, 1, 64, 0, 16),       # a one-token prompt
    (4, 4, 7, 256, 31, 1),      # the widest head, one-token blocks, odd key count
    (6, 6, 40, 72, 0, 16),      # SigLIP's and Qwen3-VL's towers: 4.5 vectors a head
    (16, 16, 25, 80, 9, 16),    # Qwen2-VL's tower: 5 vectors a head
    (4, 2, 19, 8, 3, 16),       # the narrowest head: half a vector
])
@pytest.mark.parametrize("causal", [True, False])
def test_chunks_match_the_reference(heads, kv_heads, n, dim, start, block_size, causal):
    """Within bfloat16's rounding of the weights and the output: never further from the float64
    answer than twice torch's own bfloat16 attention is, at most, and on average."""
    q, k_cache, v_cache, table, keys, values = _case(heads, kv_heads, n, dim, start, block_size)
    out = torch.full_like(q, float("nan"))
    attend(q, k_cache, v_cache, table, block_size, start, dim ** -0.5, out, causal)
    exact = reference(q, keys, values, start, causal)
    torch_bf16 = reference(q, keys, values, start, causal, torch.bfloat16)
    ours_error, torch_error = (out.double() - exact).abs(), (torch_bf16.double() - exact).abs()
    assert ours_error.max() <= 2 * torch_error.max() + 1e-3
    assert ours_error.mean() <= 2 * torch_error.mean() + 1e-6


@pytest.mark.usefixtures("served")
def test_strided_queries_and_outputs_and_thread_counts():
    """Query rows inside a wider projection (q of a fused qkv) and output rows of a wider
    buffer, at 1 and 2 threads: the same answer as contiguous rows."""
    q, k_cache, v_cache, table, _, _ = _case(4, 2, 45, 64, 20, 16, seed=3)
    wide = torch.zeros(45, 4 * 64 + 64, dtype=torch.bfloat16)
    wide[:, :256] = q.reshape(45, 256)
    strided = wide[:, :256].view(45, 4, 64)
    expected = torch.empty_like(q)
    attend(q, k_cache, v_cache, table, 16, 20, 0.125, expected)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out_wide = torch.zeros(45, 300, dtype=torch.bfloat16)
            out = out_wide[:, :256].view(45, 4, 64)
            attend(strided, k_cache, v_cache, table, 16, 20, 0.125, out)
            assert torch.equal(out, expected)
            assert not out_wide[:, 256:].any()  # nothing written past the rows
    finally:
        torch.set_num_threads(previous)


@pytest.mark.usefixtures("served")
def test_what_it_cannot_serve_raises_instead_of_reading_out_of_bounds():
    q, k_cache, v_cache, table, _, _ = _case(4, 2, 10, 64, 0, 16)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="outside the cache"):
        attend(q, k_cache, v_cache, torch.tensor([99], dtype=torch.int32), 16, 0, 0.125, out)
    with pytest.raises(ValueError, match="a size"):  # a table too short for the tokens
        attend(q, k_cache, v_cache, table, 16, 40, 0.125, out)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attend(torch.zeros(10, 3, 64, dtype=torch.bfloat16), k_cache, v_cache, table, 16, 0, 0.125,
               torch.empty(10, 3, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        attend(q.float(), k_cache, v_cache, table, 16, 0, 0.125, out.float())
    assert not flash_bf16.serves(76) and not flash_bf16.serves(264)  # multiples of 8 up to 256
    assert not flash_bf16.supports(k_cache, q.float())


@pytest.mark.usefixtures("served")
def test_the_backend_hands_bfloat16_chunks_to_the_kernel_at_any_context(monkeypatch):
    """A bfloat16 chunk goes to flash_bf16 however long its context (up to
    ``FLASH_BF16_MAX_KEYS``), not to torch's flash past paged_prefill.c's 896 keys; past the
    bound torch's; the answers agree with torch's path within bfloat16's rounding."""
    calls = []
    real = flash_bf16.flash_bf16
    monkeypatch.setattr(flash_bf16, "flash_bf16", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    torch.manual_seed(4)
    block_size, heads, kv_heads, dim = 16, 4, 2, 64
    k_cache = torch.randn(128 * block_size, kv_heads, dim).bfloat16()
    v_cache = torch.randn_like(k_cache)
    # A fresh 20-token prompt and 30 tokens after 1,000 cached ones.
    chunks = [SequenceChunk([0, 1], 0, 20), SequenceChunk(list(range(2, 70)), 1000, 30)]
    q = torch.randn(50, heads, dim).bfloat16()
    k, v = torch.randn(50, kv_heads, dim).bfloat16(), torch.randn(50, kv_heads, dim).bfloat16()
    backend = CPUPagedBackend(block_size, "auto")
    out = backend.forward(q, k, v, (k_cache.clone(), v_cache.clone()), backend.prepare_metadata(chunks, 0), 0.125)
    assert calls == [20, 30]
    torch_backend = CPUPagedBackend(block_size, "torch")
    expected = torch_backend.forward(q, k, v, (k_cache.clone(), v_cache.clone()),
                                     torch_backend.prepare_metadata(chunks, 0), 0.125)
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=2e-2)
    calls.clear()
    monkeypatch.setattr(cpu_paged, "FLASH_BF16_MAX_KEYS", 1000)
    backend.forward(q, k, v, (k_cache.clone(), v_cache.clone()), backend.prepare_metadata(chunks, 0), 0.125)
    assert calls == [20]  # 1,030 keys: past the bound


class _TowerAttention(torch.nn.Module):
    is_causal = False


@pytest.mark.usefixtures("served")
def test_tower_attention_runs_bfloat16_images_through_the_kernel(monkeypatch):
    """transformers' contract ([B, H, N, D] in, [B, N, H, D] out), a batch of two images as
    the towers lay them out (projections transposed), within bfloat16's rounding of torch's."""
    calls = []
    real = flash_bf16.flash_bf16
    monkeypatch.setattr(flash_bf16, "flash_bf16", lambda *a, **k: calls.append(k["causal"]) or real(*a, **k))
    torch.manual_seed(5)
    batch, tokens, heads, dim = 2, 77, 8, 64
    q, k, v = (torch.randn(batch, tokens, heads, dim).bfloat16().transpose(1, 2) for _ in range(3))
    out, weights = tower_attention(_TowerAttention(), q, k, v, None, scaling=0.125)
    assert weights is None and out.shape == (batch, tokens, heads, dim) and calls == [False, False]
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.125).transpose(1, 2)
    torch_bf16 = F.scaled_dot_product_attention(q, k, v, scale=0.125).transpose(1, 2)
    assert (out.double() - exact).abs().max() <= 2 * (torch_bf16.double() - exact).abs().max() + 1e-3


@pytest.mark.usefixtures("each_kernel_variant")
def test_tower_attention_is_transformers_sdpa_where_the_kernel_does_not_serve():
    """float32, a mask, or a causal module: transformers' SDPA function, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS.get_interface(TOWER_ATTENTION, None) is tower_attention
    torch.manual_seed(6)
    q, k, v = (torch.randn(1, 4, 33, 64) for _ in range(3))
    mask = torch.zeros(1, 1, 33, 33)
    mask[..., 5:] = float("-inf")
    causal = _TowerAttention()
    causal.is_causal = True
    for dtype, attention_mask, module in ((torch.float32, None, _TowerAttention()),
                                          (torch.bfloat16, mask, _TowerAttention()), (torch.bfloat16, None, causal)):
        args = (q.to(dtype), k.to(dtype), v.to(dtype),
                None if attention_mask is None else attention_mask.to(dtype))
        ours, _ = tower_attention(module, *args, scaling=0.125)
        theirs, _ = sdpa_attention_forward(module, *args, scaling=0.125)
        assert torch.equal(ours, theirs)
