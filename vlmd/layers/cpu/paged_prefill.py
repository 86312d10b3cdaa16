"""The binding of ``paged_prefill.c``: a prefill chunk's attention, causal, against its
sequence's keys read through the block table.

``paged_prefill(q, k_cache, v_cache, block_ids, start, scale, out)`` writes the attention
of ``q`` (the chunk's n tokens, positions ``start ..``) into ``out``, after the caller has
written the chunk's own K/V into the cache. ``supports()`` says whether the kernel serves
a layer (built here, float32, a head size it has a copy for).
"""

from __future__ import annotations


import torch

from vlmd.layers.cpu.library import load_functions

_ERRORS = {-1: "heads not a multiple of KV heads", -2: "a head size without a copy", -3: "a size or stride",
           -5: "out of memory", -6: "a block id outside the cache"}
_NAMES = ("vlmd_paged_prefill", "vlmd_paged_prefill_serves")  # signatures: kernels.h; serves: 1 if a head size has a copy


def _kernel():
    functions = load_functions(_NAMES)
    return None if functions is None else functions["vlmd_paged_prefill"]


def available() -> bool:
    return _kernel() is not None


def _serves(dim: int) -> bool:
    return bool(load_functions(_NAMES)["vlmd_paged_prefill_serves"](dim))


def supports(k_cache: torch.Tensor, q: torch.Tensor) -> bool:
    """Float32 queries and cache on the CPU, a contiguous cache, a head size with a copy."""
    if _kernel() is None:
        return False
    return (k_cache.device.type == "cpu" and k_cache.dtype == torch.float32 and q.dtype == torch.float32
            and k_cache.is_contiguous() and _serves(k_cache.shape[-1]) and q.stride(-1) == 1
            and q.stride(1) == q.shape[-1])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                  block_size: int, start: int, scale: float, out: torch.Tensor, causal: bool = True) -> None:
    """q, out: [n, H, D] float32 (each token's heads contiguous; tokens may be strided);
    block_ids: int32 [blocks] covering ``start + n`` tokens of ``block_size``."""
    function = _kernel()
    if function is None:
        raise RuntimeError("the native paged prefill kernel library is not loaded here")
    tokens, heads, dim = q.shape
    if out.shape != q.shape or out.dtype != torch.float32 or out.stride(-1) != 1 or out.stride(1) != dim:
        raise ValueError("the output must be float32 of the queries' shape, each token's heads contiguous")
    if block_ids.dtype != torch.int32 or not block_ids.is_contiguous():
        raise ValueError("block ids must be a contiguous int32 tensor")
    code = function(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_ids.data_ptr(),
                    block_ids.numel(), k_cache.shape[0], block_size, start, tokens, heads, k_cache.shape[1], dim,
                    scale, int(causal), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if code != 0:
        raise ValueError(f"native paged prefill cannot serve this chunk: {_ERRORS.get(code, code)}")
