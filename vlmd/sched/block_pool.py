"""The pool of fixed-size KV blocks: ids only; the runner owns the tensors."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """A free list over ``num_blocks`` block ids.

    Freed blocks go to the back and are taken from the front, so the block freed longest
    ago is reused first (the order a prefix cache wants for eviction).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ValueError(f"asked for {count} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
