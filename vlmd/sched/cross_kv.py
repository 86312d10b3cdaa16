"""The cross-attention pool: an encoder-decoder's encoder-side K/V in blocks of their own.

A request's cross-attention K/V (Whisper's audio window, Llama 3.2 Vision's images) are
computed once, from its items' encoder output, and read by every later step; they never grow
and no other request shares them. So a request's cross table is allocated whole when it is
first scheduled (its cross tokens are known from its items), held unchanged for its life and
freed when it ends or is preempted (a resumed request computes them again from the encoder
output). Not prefix-cached: the K/V depend on the encoder input alone, which a block hash of
the text does not name, and a request holds them whole or not at all (docs/decisions.md D93).

Blocks are handed out as one consecutive run where the pool has one (first fit): the runner
then reads a request's K/V as a view of the pool's tensors, with no gather. Torch-free.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from vlmd.types import MultiModalItem


def cross_tokens_of(items: Sequence[MultiModalItem]) -> int:
    """Encoder tokens a request's decoder cross-attends to: those of its items without
    placeholders (an encoder-decoder's inputs), which the runner turns into cross K/V."""
    return sum(item.num_encoder_tokens for item in items if item.length == 0)


def is_consecutive(block_ids: Sequence[int]) -> bool:
    """Whether a table is one run ``first, first + 1, ...`` (read as a view, not gathered)."""
    return all(b == a + 1 for a, b in zip(block_ids, block_ids[1:]))


class CrossPool:
    """Blocks of the cross-attention layers and every request's table in them."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the cross-attention pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # sorted, so runs are easy to find
        self.tables: dict[str, list[int]] = {}
        self.peak_request_blocks = 0  # the most blocks one request has held
        self.num_gathered_tables = 0  # tables that had to be split (fragmentation), ever

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, request_id: str, count: int) -> list[int]:
        """The request's whole table: the first run of ``count`` consecutive free blocks, else
        the lowest free blocks (read by a gather)."""
        if request_id in self.tables:
            raise ValueError(f"request {request_id!r} already holds cross-attention blocks")
        if count > len(self._free):
            raise ValueError(f"asked for {count} cross-attention blocks, {len(self._free)} free")
        start = self._first_run(count)
        if start is None:
            taken = self._free[:count]
            self.num_gathered_tables += 1
        else:
            taken = self._free[start:start + count]
        del self._free[start or 0:(start or 0) + count]
        self.tables[request_id] = taken
        self.peak_request_blocks = max(self.peak_request_blocks, count)
        return list(taken)

    def free(self, request_id: str) -> None:
        for block_id in self.tables.pop(request_id, []):
            bisect.insort(self._free, block_id)

    def _first_run(self, count: int) -> int | None:
        """Index into the free list where ``count`` consecutive block ids start, if any."""
        if count == 0:
            return 0
        run_start = 0
        for index in range(1, len(self._free) + 1):
            if index - run_start == count:
                return run_start
            if index < len(self._free) and self._free[index] != self._free[index - 1] + 1:
                run_start = index
        return None
