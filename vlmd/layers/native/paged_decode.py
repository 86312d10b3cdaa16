"""The binding of ``paged_decode.c``: every decode of a step against its paged context.

``paged_decode(q, k_cache, v_cache, tables, scale)`` reads each decode's K/V in place
through its block table; the caller builds ``DecodeTables`` once per step and every layer
reuses them. ``available()`` says whether the kernel was built on this host (else the
caller keeps its torch path).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from vlmd.layers.native.build import load_native

_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {-1: "heads not a multiple of KV heads, or over 128", -2: "head size over 256", -3: "KV dtype",
           -4: "a context length outside its block table", -5: "out of memory",
           -6: "a block id outside the cache"}
_function = None


def _kernel():
    global _function
    if _function is None:
        library = load_native("paged_decode")
        if library is None:
            _function = False
        else:
            function = library.vlmd_paged_decode
            pointer, integer = ctypes.c_void_p, ctypes.c_int
            function.argtypes = [pointer, pointer, pointer, integer, pointer, pointer, pointer,
                                 integer, integer, integer, integer, integer, integer, ctypes.c_int64, ctypes.c_float,
                                 integer, integer]
            function.restype = integer
            _function = function
    return _function or None


def available() -> bool:
    return _kernel() is not None


def supports(k_cache: torch.Tensor, heads: int) -> bool:
    """Whether the kernel serves this layer's cache: on the CPU, float32 or bfloat16,
    contiguous, a head size and head count the kernel's fixed buffers hold."""
    return (k_cache.device.type == "cpu" and k_cache.dtype in _KV_DTYPES and k_cache.is_contiguous()
            and k_cache.shape[-1] <= 256 and heads <= 128 and heads % k_cache.shape[1] == 0)


@dataclass
class DecodeTables:
    """A step's decodes as the kernel reads them: built once, used by every layer."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor  # [B] int32, each decode's own token included
    block_size: int

    @classmethod
    def of(cls, block_ids: list[list[int]], context_lens: list[int], block_size: int) -> "DecodeTables":
        widest = max(-(-length // block_size) for length in context_lens)
        rows = [ids[:widest] + [0] * (widest - len(ids[:widest])) for ids in block_ids]
        return cls(torch.tensor(rows, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32), block_size)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: DecodeTables,
                 scale: float, part_tokens: int = 0) -> torch.Tensor:
    """[B, H, D] queries -> [B, H, D] float32 attention outputs. ``part_tokens`` > 0 splits
    every context into parts of that many tokens (tests); 0 splits only as far as the
    threads need work."""
    function = _kernel()
    if function is None:
        raise RuntimeError("the native paged decode kernel is not built on this host")
    batch, heads, dim = q.shape
    queries = q.float().contiguous()
    out = torch.empty(batch, heads, dim, dtype=torch.float32)
    code = function(
        queries.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _KV_DTYPES[k_cache.dtype],
        tables.block_tables.data_ptr(), tables.context_lens.data_ptr(), out.data_ptr(),
        batch, heads, k_cache.shape[1], dim, tables.block_size, tables.block_tables.shape[1],
        k_cache.shape[0], scale,
        torch.get_num_threads(), part_tokens,
    )
    if code != 0:
        raise ValueError(f"native paged decode cannot serve this batch: {_ERRORS.get(code, code)}")
    return out
