"""The binding of ``paged_decode.c``: every decode of a step against its paged context.

``paged_decode(q, k_cache, v_cache, tables, scale)`` reads each decode's K/V in place
through its block table, and the blocks that several decodes share at the start of their
tables once for all of them (cascade); the caller builds ``DecodeTables`` once per step
and every layer reuses them. ``window``: a sliding-window layer's decodes, each attending
to its last ``window`` tokens only, through its window group's table (entries before the
window may be FREED). ``available()`` says whether a kernel library is loaded here (else the
caller keeps its torch path). ``bf16_dot_scores()``: whether bfloat16 caches' scores are
AVX512-BF16 dot products (the host decides; a test or bench compares the two paths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmd.layers.cpu.library import load_functions

_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {-1: "heads not a multiple of KV heads, or too many", -2: "head size too large", -3: "KV dtype",
           -4: "a context length outside its block table", -5: "out of memory",
           -6: "a block id outside the cache",
           -7: "a shared-prefix group that is empty, not whole blocks, overlapping, as long as a context "
               "or in a windowed layer"}
# Signatures: kernels.h; limit: 0 heads, 1 head size.
_NAMES = ("vlmd_paged_decode", "vlmd_paged_decode_limit", "vlmd_paged_decode_bf16_dot")


def _kernel():
    functions = load_functions(_NAMES)
    return None if functions is None else functions["vlmd_paged_decode"]


def _limit(which: int) -> int:
    return load_functions(_NAMES)["vlmd_paged_decode_limit"](which)


def available() -> bool:
    return _kernel() is not None


def bf16_dot_scores(wanted: bool | None = None) -> bool:
    """Whether a bfloat16 cache's scores (head sizes 32, 64, 128, 256; decodes stacked on a
    shared prefix: up to 128) are AVX512-BF16 dot products of the query rounded to bfloat16
    with the keys as they lie, rather than float32 products of the widened keys
    (``paged_decode.c`` says why). The host decides by default: yes where it has the instruction and the loaded
    variant built it. ``wanted`` sets it (True only where it can be); returns the setting
    then in force (False where no kernel library is loaded)."""
    functions = load_functions(_NAMES)
    if functions is None:
        return False
    return bool(functions["vlmd_paged_decode_bf16_dot"](-1 if wanted is None else int(wanted)))


def supports(k_cache: torch.Tensor, heads: int) -> bool:
    """Whether the kernel serves this layer's cache: on the CPU, float32 or bfloat16,
    contiguous, a head size and head count the kernel's fixed buffers hold."""
    if _kernel() is None:
        return False
    return (k_cache.device.type == "cpu" and k_cache.dtype in _KV_DTYPES and k_cache.is_contiguous()
            and k_cache.shape[-1] <= _limit(1) and heads <= _limit(0) and heads % k_cache.shape[1] == 0)


@dataclass
class DecodeTables:
    """A step's decodes as the kernel reads them: built once, used by every layer."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor  # [B] int32, each decode's own token included
    block_size: int
    # Decodes sharing a prefix (cascade): group g is rows group_members[group_offsets[g]:
    # group_offsets[g + 1]], whose tables agree on their first group_tokens[g] tokens.
    group_offsets: torch.Tensor  # [G + 1] int32
    group_members: torch.Tensor  # [sum of members] int32
    group_tokens: torch.Tensor  # [G] int32, whole blocks

    @classmethod
    def of(cls, block_ids: list[list[int]], context_lens: list[int], block_size: int,
           shared: list[tuple[list[int], int]] = ()) -> "DecodeTables":
        """``shared``: (decode rows, blocks they have in common at the start), each row in
        at most one group, fewer blocks than its context holds."""
        widest = max(-(-length // block_size) for length in context_lens)
        rows = [ids[:widest] + [0] * (widest - len(ids[:widest])) for ids in block_ids]
        offsets, members = [0], []
        for group, _ in shared:
            members.extend(group)
            offsets.append(len(members))
        return cls(
            torch.tensor(rows, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32), block_size,
            torch.tensor(offsets, dtype=torch.int32), torch.tensor(members, dtype=torch.int32),
            torch.tensor([blocks * block_size for _, blocks in shared], dtype=torch.int32),
        )


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: DecodeTables,
                 scale: float, part_tokens: int = 0, window: int | None = None) -> torch.Tensor:
    """[B, H, D] queries -> [B, H, D] float32 attention outputs. ``part_tokens`` > 0 splits
    every context into parts of that many tokens (tests); 0 splits only as far as the
    threads need work. ``window``: each decode attends to its last ``window`` tokens (keys
    at positions above its own minus ``window``), as a sliding-window layer's do; ``tables``
    then have no shared-prefix groups."""
    function = _kernel()
    if function is None:
        raise RuntimeError("the native paged decode kernel library is not loaded here")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be >= 1 token, got {window}")
    batch, heads, dim = q.shape
    queries = q.float().contiguous()
    out = torch.empty(batch, heads, dim, dtype=torch.float32)
    code = function(
        queries.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _KV_DTYPES[k_cache.dtype],
        tables.block_tables.data_ptr(), tables.context_lens.data_ptr(), out.data_ptr(),
        batch, heads, k_cache.shape[1], dim, tables.block_size, tables.block_tables.shape[1],
        k_cache.shape[0], tables.group_tokens.shape[0], tables.group_offsets.data_ptr(),
        tables.group_members.data_ptr(), tables.group_tokens.data_ptr(), scale,
        torch.get_num_threads(), part_tokens, window or 0,
    )
    if code != 0:
        raise ValueError(f"native paged decode cannot serve this batch: {_ERRORS.get(code, code)}")
    return out
