"""The pool of fixed-size KV blocks, with the prefix cache: ids and hashes only.

A block is free when no request references it. Free blocks sit in LRU order; a free block
that still holds a full, hashed block of some prompt stays findable by its hash until it
is taken for reuse, so a later request with the same prefix can pick it up again.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


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
        # A cached block's key: (its KV group, the block hash), so one group never finds
        # another's block (a block id holds different layers' K/V in each group).
        self._hash_of: list[tuple[int, bytes] | None] = [None] * num_blocks
        self._by_hash: dict[tuple[int, bytes], int] = {}
        # Free blocks, least recently freed first: the next to be reused or evicted.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # The KV group each block was last allocated to, and how many referenced blocks each
        # group holds (a block serves one group at a time: its prefix key names that group).
        self._owner = [0] * num_blocks
        self.held_by: Counter[int] = Counter()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, count: int, owner: int = 0) -> list[int]:
        """``count`` free blocks for group ``owner``, least recently freed first."""
        if count > len(self._free):
            raise ValueError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._take(block_id, owner)
            blocks.append(block_id)
        return blocks

    def _take(self, block_id: int, owner: int) -> None:
        self.forget_hash(block_id)
        self._ref_counts[block_id] = 1
        self._owner[block_id] = owner
        self.held_by[owner] += 1

    def allocate_run(self, count: int, owner: int = 0) -> list[int]:
        """``count`` consecutive block ids where the free blocks have such a run (the lowest,
        among blocks that hold no cached prefix first), else any ``count`` free blocks: a
        table taken whole and read as one view of the cache (a request's cross-attention
        K/V, a recurrent state) needs no gather then."""
        if count > len(self._free):
            raise ValueError(f"asked for {count} blocks, {len(self._free)} free")
        uncached = sorted(block for block in self._free if self._hash_of[block] is None)
        for candidates in (uncached, sorted(self._free)):
            blocks = _lowest_run(candidates, count)
            if blocks is not None:
                for block_id in blocks:
                    del self._free[block_id]
                    self._take(block_id, owner)
                return blocks
        return self.allocate(count, owner)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; unreferenced ones become reusable, in order."""
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                self.held_by[self._owner[block_id]] -= 1

    # ---- prefix cache -----------------------------------------------------------------

    def lookup(self, key: tuple[int, bytes]) -> int | None:
        """The free or held block cached under ``key`` (group, block hash), if any."""
        return self._by_hash.get(key) if self.enable_caching else None

    def count_unreferenced(self, block_ids: list[int]) -> int:
        return sum(1 for block_id in block_ids if self._ref_counts[block_id] == 0)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
                self.held_by[self._owner[block_id]] += 1
            self._ref_counts[block_id] += 1

    def cache(self, block_id: int, key: tuple[int, bytes]) -> None:
        """Make a full block findable by its key (group, block hash); the first block with a
        key keeps it."""
        if not self.enable_caching or self._hash_of[block_id] is not None:
            return
        if key not in self._by_hash:
            self._by_hash[key] = block_id
            self._hash_of[block_id] = key

    def forget_hash(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            self._hash_of[block_id] = None
            if self._by_hash.get(block_hash) == block_id:
                del self._by_hash[block_hash]


def _lowest_run(ordered: list[int], count: int) -> list[int] | None:
    """The first ``count`` consecutive ids in the sorted ``ordered``, or None."""
    run_start = 0
    for index in range(1, len(ordered) + 1):
        if index - run_start >= count:
            return ordered[run_start:run_start + count]
        if index < len(ordered) and ordered[index] != ordered[index - 1] + 1:
            run_start = index
    return None
