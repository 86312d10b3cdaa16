"""The pool of fixed-size KV blocks, with the prefix cache: ids and hashes only.

A block is free when no request references it. Free blocks sit in LRU order; a free block
that still holds a full, hashed block of some prompt stays findable by its hash until it
is taken for reuse, so a later request with the same prefix can pick it up again.
"""

from __future__ import annotations

from collections import OrderedDict


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that hold ``num_tokens`` (the last one may be partly full)."""
    return -(-num_tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        # Free blocks, least recently freed first: the next to be reused or evicted.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ValueError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self.forget_hash(block_id)
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; unreferenced ones become reusable, in order."""
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    # ---- prefix cache -----------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash) if self.enable_caching else None

    def count_unreferenced(self, block_ids: list[int]) -> int:
        return sum(1 for block_id in block_ids if self._ref_counts[block_id] == 0)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Make a full block findable by its hash (the first block with a hash keeps it)."""
        if not self.enable_caching or self._hash_of[block_id] is not None:
            return
        if block_hash not in self._by_hash:
            self._by_hash[block_hash] = block_id
            self._hash_of[block_id] = block_hash

    def forget_hash(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            self._hash_of[block_id] = None
            if self._by_hash.get(block_hash) == block_id:
                del self._by_hash[block_hash]
