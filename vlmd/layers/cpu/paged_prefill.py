"""The binding of ``paged_prefill.c``: a prefill chunk's attention, causal, against its
sequence's keys read through the block table.

``paged_prefill(q, k_cache, v_cache, block_ids, start, scale, out)`` writes the attention
of ``q`` (the chunk's n tokens, positions ``start ..``) into ``out``, after the caller has
written the chunk's own K/V into the cache. ``supports()`` says whether the kernel serves
a layer (built here, float32 or bfloat16, a head size it has a copy for). A bfloat16 cache
is read in place (its chunk's keys and values widened once inside); the chunk's queries
and output cross to float32 here, in the kernel's layout.
"""

from __future__ import annotations


import torch

from vlmd.layers.cpu.library import load_functions

_ERRORS = {-1: "heads not a multiple of KV heads", -2: "a head size without a copy", -3: "a size or stride",
           -5: "out of memory", -6: "a block id outside the cache"}
_NAMES = ("vlmd_paged_prefill", "vlmd_paged_prefill_bf16", "vlmd_paged_prefill_serves")  # kernels.h
_ENTRY = {torch.float32: "vlmd_paged_prefill", torch.bfloat16: "vlmd_paged_prefill_bf16"}


def _kernel(dtype: torch.dtype = torch.float32):
    functions = load_functions(_NAMES)
    return None if functions is None or dtype not in _ENTRY else functions[_ENTRY[dtype]]


def available() -> bool:
    return _kernel() is not None


def _serves(dim: int) -> bool:
    return bool(load_functions(_NAMES)["vlmd_paged_prefill_serves"](dim))


def supports(k_cache: torch.Tensor, q: torch.Tensor) -> bool:
    """Queries and cache of one dtype, float32 or bfloat16, on the CPU, a contiguous cache,
    a head size with a copy."""
    if _kernel(k_cache.dtype) is None:
        return False
    return (k_cache.device.type == "cpu" and q.dtype == k_cache.dtype
            and k_cache.is_contiguous() and _serves(k_cache.shape[-1]) and q.stride(-1) == 1
            and q.stride(1) == q.shape[-1])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                  block_size: int, start: int, scale: float, out: torch.Tensor, causal: bool = True) -> None:
    """q, out: [n, H, D] of the cache's dtype, float32 or bfloat16 (each token's heads
    contiguous; tokens may be strided); block_ids: int32 [blocks] covering ``start + n``
    tokens of ``block_size``."""
    function = _kernel(k_cache.dtype)
    if function is None:
        raise RuntimeError(f"no native paged prefill kernel for {k_cache.dtype} caches is loaded here")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype or out.dtype != k_cache.dtype:
        raise ValueError("queries, caches and output must share one dtype")
    tokens, heads, dim = q.shape
    if out.shape != q.shape or out.stride(-1) != 1 or out.stride(1) != dim:
        raise ValueError("the output must have the queries' shape, each token's heads contiguous")
    narrow = None
    if k_cache.dtype == torch.bfloat16:
        q, narrow, out = q.float(), out, torch.empty(q.shape, dtype=torch.float32)
    if block_ids.dtype != torch.int32 or not block_ids.is_contiguous():
        raise ValueError("block ids must be a contiguous int32 tensor")
    code = function(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_ids.data_ptr(),
                    block_ids.numel(), k_cache.shape[0], block_size, start, tokens, heads, k_cache.shape[1], dim,
                    scale, int(causal), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if code != 0:
        raise ValueError(f"native paged prefill cannot serve this chunk: {_ERRORS.get(code, code)}")
    if narrow is not None:
        narrow.copy_(out)
