"""The binding of ``flash_bf16.c``: attention over bfloat16 queries, keys and values by
AVX512-BF16's dot product, causal against a sequence's paged cache (a prefill chunk) or
every query against every key (a vision tower's image).

``serves(dim)`` says whether this host and library serve a head size (AVX512-BF16, a
multiple of 8 up to 256); where it does not, callers keep their other path.
"""

from __future__ import annotations

import torch

from vlmd.layers.cpu.library import load_functions

_ERRORS = {-1: "heads not a multiple of KV heads", -2: "a head size or host this kernel does not serve",
           -3: "a size or stride", -5: "out of memory", -6: "a block id outside the cache"}
_NAMES = ("vlmd_flash_bf16", "vlmd_flash_bf16_serves")  # kernels.h


def serves(dim: int) -> bool:
    functions = load_functions(_NAMES)
    return functions is not None and bool(functions["vlmd_flash_bf16_serves"](dim))


def supports(k_cache: torch.Tensor, q: torch.Tensor) -> bool:
    """bfloat16 queries and a contiguous bfloat16 cache on the CPU, each token's heads
    contiguous, a head size served here."""
    return (k_cache.dtype == torch.bfloat16 and q.dtype == torch.bfloat16 and k_cache.device.type == "cpu"
            and k_cache.is_contiguous() and q.stride(-1) == 1 and q.stride(1) == q.shape[-1]
            and serves(k_cache.shape[-1]))


def flash_bf16(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
               block_size: int, start: int, scale: float, out: torch.Tensor, causal: bool = True) -> None:
    """q, out: [n, H, D] bfloat16 (each token's heads contiguous; tokens may be strided);
    caches [slots, Hkv, D]; block_ids: int32 [blocks] covering ``start + n`` tokens of
    ``block_size``. Writes the attention of ``q`` (positions ``start ..``) into ``out``."""
    functions = load_functions(_NAMES)
    if functions is None:
        raise RuntimeError("no native kernel library is loaded here")
    if not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16):
        raise ValueError("queries, caches and output must all be bfloat16")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError("the caches must be contiguous and of one shape")
    tokens, heads, dim = q.shape
    if q.stride(-1) != 1 or q.stride(1) != dim:
        raise ValueError("each token's query heads must be contiguous")
    if out.shape != q.shape or out.stride(-1) != 1 or out.stride(1) != dim:
        raise ValueError("the output must have the queries' shape, each token's heads contiguous")
    if block_ids.dtype != torch.int32 or not block_ids.is_contiguous():
        raise ValueError("block ids must be a contiguous int32 tensor")
    code = functions["vlmd_flash_bf16"](
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_ids.data_ptr(), block_ids.numel(),
        k_cache.shape[0], block_size, start, tokens, heads, k_cache.shape[1], dim, scale, int(causal),
        out.data_ptr(), out.stride(0), torch.get_num_threads())
    if code != 0:
        raise ValueError(f"native bfloat16 attention cannot serve this: {_ERRORS.get(code, code)}")
