"""Which KV blocks each request holds."""

from __future__ import annotations

from vlmd.sched.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Maps requests to block ids and grows their tables as they get longer."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow the request's table to hold ``num_total_tokens``; None if blocks run out.

        Returns only the newly added block ids (the runner appends them).
        """
        blocks = self._blocks.setdefault(request_id, [])
        missing = blocks_needed(num_total_tokens, self.block_size) - len(blocks)
        if missing <= 0:
            return []
        if missing > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.allocate(missing)
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            # Reverse so a request's tail blocks are reused before its head blocks.
            self.pool.free(blocks[::-1])
