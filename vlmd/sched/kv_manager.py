"""The KV coordinator: every group's tables over one pool, asked once per allocation.

The scheduler talks to this one object: it finds the longest prefix hit that every group
can serve, grows a request's tables in every group together (or in none: the pool must have
the blocks that all groups want at once), gives back the blocks windows have left behind,
and frees a request's blocks in every group. Each group's own rules live in its manager
(``kv_managers.py``); the groups and their layers in ``kv_spec.py``. Tables and new blocks
travel keyed by group index (``dict[int, list[int]]``), one field in the step records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmd.sched.block_hash import extend_block_hashes
from vlmd.sched.block_pool import BlockPool
from vlmd.sched.kv_managers import FREED, GroupManager, RecurrentStateManager, manager_for
from vlmd.sched.kv_spec import KVCacheConfig
from vlmd.sched.request import Request


@dataclass
class PrefixHit:
    """Cached blocks a request adopts at admission: per group, the entries of a hit of
    ``num_blocks`` blocks (a window group's are ``FREED`` before the window)."""

    num_blocks: int = 0
    tables: dict[int, list[int]] = field(default_factory=dict)
    # Recurrent-state groups: the snapshot whose pages the request's state is copied from.
    state_sources: dict[int, list[int]] = field(default_factory=dict)


class KVCacheManager:
    """Maps requests to block ids in every KV group and grows their tables as they get longer."""

    def __init__(self, config: KVCacheConfig, enable_prefix_caching: bool = True, avoid_inside_items: bool = False):
        """``avoid_inside_items``: the scheduler computes each item in one chunk, so no
        recurrent-state snapshot is placed inside one (``kv_spec.snapshot_positions``)."""
        self.config = config
        self.block_size = config.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(config.num_blocks, enable_caching=enable_prefix_caching)
        self.groups: list[GroupManager] = [manager_for(spec, self.pool, config.block_size, avoid_inside_items)
                                           for spec in config.groups]
        self._windowed = [group for group in self.groups if group.spec.window is not None]
        self._recurrent = [group for group in self.groups if isinstance(group, RecurrentStateManager)]
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def tables(self, request_id: str) -> dict[int, list[int]]:
        """The request's table in every group (``FREED`` where a window gave a block back), copied."""
        return {group.spec.index: list(group.tables.get(request_id, [])) for group in self.groups}

    def new_blocks(self, request_id: str) -> dict[int, list[int]]:
        """What the last ``allocate_slots`` of the request appended to each group's table
        (groups it appended nothing to are left out)."""
        return {group.spec.index: list(group.last_new[request_id]) for group in self.groups
                if group.last_new.get(request_id)}

    def new_snapshots(self, request_id: str) -> dict[int, list[int]]:
        """Recurrent-state groups: the pages the last allocation took for a snapshot of the
        request's state, which the runner fills once the chunk has run (none: left out)."""
        return {group.spec.index: list(group.last_snapshot[request_id]) for group in self._recurrent
                if group.last_snapshot.get(request_id)}

    def chunk_limit(self, request: Request, start: int, num_new: int) -> int:
        """``num_new`` tokens from ``start``, cut so the chunk ends at the request's next
        recurrent-state snapshot position if one lies inside it (D105)."""
        if not self._recurrent or not self.enable_prefix_caching:
            return num_new
        for position in self._recurrent[0].snapshot_positions(request):
            if start < position < start + num_new:
                return position - start
        return num_new

    def group_stats(self) -> list[dict]:
        """Per group: its kind, layers, the blocks requests hold now, the most one request held."""
        return [group.stats() for group in self.groups]

    def computed_blocks(self, request: Request) -> PrefixHit:
        """The longest run of cached blocks that starts the request's tokens and that every
        group can serve (else a shorter one, or none).

        At least the last token is always left to compute: its logits are needed.
        """
        if not self.enable_prefix_caching:
            return PrefixHit()
        self._update_hashes(request)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        valid = [True] * (len(hashes) + 1)
        for group in self.groups:
            valid = [a and b for a, b in zip(valid, group.hit_lengths(hashes))]
            if not any(valid[1:]):
                return PrefixHit()
        length = max(k for k, ok in enumerate(valid) if ok)
        return PrefixHit(length, {group.spec.index: group.hit_entries(hashes[:length]) for group in self.groups},
                         {group.spec.index: group.state_source(hashes[:length]) for group in self._recurrent if length})

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once, when its request is admitted (not at every retry)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_total_tokens: int,
                       computed: PrefixHit | None = None) -> dict[int, list[int]] | None:
        """Grow the request's tables in every group to hold ``num_total_tokens``; None if the
        pool cannot give every group what it wants at once (then nothing is taken).

        A group taken whole (cross-attention, recurrent state) takes its table with the
        request's first allocation (or its first after a preemption). ``computed``: a prefix
        hit to adopt first (a request being admitted). Window blocks the request's next query
        (``request.num_computed_tokens``) cannot see are given back first. Returns the new
        block ids per group (``new_blocks`` has them too).
        """
        computed = computed or PrefixHit()
        for group in self._recurrent:
            group.settle(request.request_id)
        if self.enable_prefix_caching:
            self._update_hashes(request)  # a snapshot is keyed by the hash where it is taken
        if self._windowed:
            self.release_out_of_window(request.request_id, request.num_computed_tokens)
        # A recurrent-state snapshot is an optimisation: a pool short of its pages takes none.
        try:
            for with_snapshots in (True, False) if self._recurrent else (True,):
                for group in self._recurrent:
                    group.snapshots_off = not with_snapshots
                plans, wanted, hit_blocks = self._plan(request, num_total_tokens, computed)
                # Hit blocks that nobody holds sit on the free list: they cannot also be new blocks.
                if wanted <= self.pool.num_free_blocks - self.pool.count_unreferenced(hit_blocks):
                    self._grow(request, num_total_tokens, plans, hit_blocks, computed)
                    return self.new_blocks(request.request_id)
            return None
        finally:
            for group in self._recurrent:
                group.snapshots_off = False

    def _plan(self, request: Request, num_total_tokens: int, computed: PrefixHit):
        plans = []
        wanted = 0
        hit_blocks: list[int] = []
        for group in self.groups:
            adopted = computed.tables.get(group.spec.index, [])
            hit_blocks.extend(block for block in adopted if block != FREED)
            hit_blocks.extend(computed.state_sources.get(group.spec.index, []))
            count = group.blocks_wanted(request, num_total_tokens, adopted)
            wanted += count
            plans.append((group, adopted, count))
        return plans, wanted, hit_blocks

    def _grow(self, request: Request, num_total_tokens: int, plans, hit_blocks: list[int], computed: PrefixHit) -> None:
        self.pool.touch(hit_blocks)
        for group in self._recurrent:
            if computed.state_sources.get(group.spec.index):
                group.adopt_source(request.request_id, computed.state_sources[group.spec.index])
        for group, adopted, count in plans:
            group.grow(request, num_total_tokens, adopted, count)
            if self.enable_prefix_caching:
                group.cache_full_blocks(request, num_total_tokens)

    def release_out_of_window(self, request_id: str, next_position: int) -> None:
        """Give back each window group's blocks that no query at ``next_position`` or later
        can read (the scheduler calls this for every running request before allocating)."""
        for group in self._windowed:
            group.release_out_of_window(request_id, next_position)

    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, request.mm_items, self.block_size)

    def forget_hashes_from(self, request_id: str, first_block: int) -> set[int]:
        """Make the request's blocks from ``first_block`` on unfindable by prefix hash (their
        contents are suspect), in every group; returns their ids (one pool: ids are unique)."""
        suspect: set[int] = set()
        for group in self.groups:
            suspect |= group.forget_hashes_from(request_id, first_block)
        return suspect

    def pending_state_pages(self) -> dict[int, set[int]]:
        """Per recurrent-state group: pages requests hold for snapshots (being made, or copied
        from) until their next step; held, though in no table."""
        return {group.spec.index: {page for entries in group.pending.values() for pages, _ in entries for page in pages}
                for group in self._recurrent}

    def held_blocks(self, request_id: str) -> set[int]:
        """The request's live blocks in every group."""
        return {block_id for group in self.groups for block_id in group.live(request_id)}

    def free(self, request_id: str) -> None:
        for group in self.groups:
            group.free(request_id)
