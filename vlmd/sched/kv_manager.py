"""Which KV blocks each request holds, and prefix-cache hits for new requests."""

from __future__ import annotations

from vlmd.sched.block_hash import extend_block_hashes
from vlmd.sched.block_pool import BlockPool
from vlmd.sched.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Maps requests to block ids and grows their tables as they get longer."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks already registered by hash
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks that starts the request's tokens.

        At least the last token is always left to compute: its logits are needed.
        """
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:limit]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once, when its request is admitted (not at every retry)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_total_tokens: int, computed: list[int] | None = None
    ) -> list[int] | None:
        """Grow the request's table to hold ``num_total_tokens``; None if blocks run out.

        ``computed`` are prefix-cache hits to adopt first (a request being admitted).
        Returns only the newly added block ids (the runner appends them).
        """
        request_id = request.request_id
        computed = computed or []
        blocks = self._blocks.get(request_id, [])
        missing = blocks_needed(num_total_tokens, self.block_size) - len(blocks) - len(computed)
        # Hit blocks that nobody holds sit on the free list: they cannot also be new blocks.
        if missing > self.pool.num_free_blocks - self.pool.count_unreferenced(computed):
            return None
        self.pool.touch(computed)
        new_blocks = computed + self.pool.allocate(max(missing, 0))
        blocks = self._blocks.setdefault(request_id, blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_total_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_total_tokens: int) -> None:
        """Register the blocks that this step fills, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        blocks = self._blocks[request.request_id]
        full = min(num_total_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached.get(request.request_id, 0)
        for index in range(start, full):
            self.pool.cache(blocks[index], request.block_hashes[index])
        self._num_cached[request.request_id] = max(start, full)

    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, request.mm_items, self.block_size)

    def forget_hashes_from(self, request_id: str, first_block: int) -> list[int]:
        """Make the request's blocks from ``first_block`` on unfindable by prefix hash (their
        contents are suspect); returns those block ids."""
        blocks = self._blocks.get(request_id, [])[first_block:]
        for block_id in blocks:
            self.pool.forget_hash(block_id)
        return blocks

    def free(self, request_id: str) -> None:
        blocks = self._blocks.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if blocks:
            # Tail blocks first: a prefix's head is shared more often, so it is evicted last.
            self.pool.free(blocks[::-1])
