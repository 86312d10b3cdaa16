"""One manager per kind of KV group: which blocks each request holds in the group's tables.

Every manager draws its blocks from the same ``BlockPool`` (``kv_spec.py``); the coordinator
(``kv_manager.py``) asks each, once per allocation, how many new blocks it wants, takes them
only where the pool has enough for all, and registers full blocks for prefix hits under the
group's own key. One interface, four behaviours:

- ``FullAttentionManager``: a table that grows a block at a time, every block kept.
- ``SlidingWindowManager``: the same, but blocks wholly before the window of the request's
  next query are given back (``release_out_of_window``) and their entries kept as ``FREED``,
  so an entry's index keeps naming the same tokens (docs/decisions.md D91).
- ``WholeRequestManager``: a table taken whole at the request's first allocation and never
  grown: cross-attention K/V (its encoder tokens' blocks, a run of consecutive ids where the
  pool has one), computed again after a hit or a preemption (D93).
- ``RecurrentStateManager``: the same for a linear-attention layer's state (a fixed number of
  pages), plus snapshots: where a chunk ends at one of the request's snapshot positions
  (``kv_spec.snapshot_positions``), the runner copies the state into pages taken for it,
  findable afterwards under the group and the block hash there; a later request whose
  prefix reaches that block starts from a copy of it (D105).

Torch-free.
"""

from __future__ import annotations

from vlmd.sched.block_pool import BlockPool, blocks_needed
from vlmd.sched.kv_spec import (
    CrossAttention,
    FullAttention,
    KVGroupSpec,
    RecurrentState,
    SlidingWindow,
    first_visible_block,
    snapshot_positions,
)
from vlmd.sched.request import Request

# A window table's entry whose block was given back (or never adopted after a prefix hit):
# no query of the request can read it. Negative, so a read of it fails loudly.
FREED = -1


class GroupManager:
    """A group's tables: the shared bookkeeping; subclasses decide how tables grow and hit."""

    caches_blocks = True  # full blocks are registered for prefix hits

    def __init__(self, spec: KVGroupSpec, pool: BlockPool, block_size: int):
        self.spec = spec
        self.pool = pool
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}  # leading entries already registered by hash
        self.first_live: dict[str, int] = {}  # entries before it are FREED (window groups)
        self.last_new: dict[str, list[int]] = {}  # what the last allocation appended
        self.peak_request_blocks = 0  # the most blocks one request has held here at once
        self._description = spec.describe()

    def key(self, block_hash: bytes) -> tuple[int, bytes]:
        return (self.spec.index, block_hash)

    def live(self, request_id: str) -> list[int]:
        table = self.tables.get(request_id, [])
        return table[self.first_live.get(request_id, 0):]

    @property
    def used_blocks(self) -> int:
        """Distinct blocks the group's tables hold now (a shared prefix block counts once)."""
        return self.pool.held_by[self.spec.index]

    # ---- prefix hits --------------------------------------------------------------------

    def hit_lengths(self, hashes: list[bytes]) -> list[bool]:
        """For each hit of ``k`` leading blocks (0 to ``len(hashes)``), whether this group
        can serve it."""
        valid = [True]
        for block_hash in hashes:
            valid.append(valid[-1] and self.pool.lookup(self.key(block_hash)) is not None)
        return valid

    def hit_entries(self, hashes: list[bytes]) -> list[int]:
        """The table entries a request adopts for a hit of ``len(hashes)`` blocks."""
        return [self.pool.lookup(self.key(block_hash)) for block_hash in hashes]

    # ---- growth -------------------------------------------------------------------------

    def blocks_wanted(self, request: Request, num_total_tokens: int, adopted: list[int]) -> int:
        """New blocks the request's table needs to hold ``num_total_tokens`` (after adopting
        ``adopted``, a prefix hit's entries)."""
        return max(0, blocks_needed(num_total_tokens, self.block_size)
                   - len(self.tables.get(request.request_id, [])) - len(adopted))

    def take(self, request: Request, count: int) -> list[int]:
        return self.pool.allocate(count, self.spec.index)

    def grow(self, request: Request, num_total_tokens: int, adopted: list[int], count: int) -> None:
        """Adopt the hit's entries (their live blocks referenced already), then ``count`` new blocks."""
        request_id = request.request_id
        new_blocks = adopted + self.take(request, count)
        table = self.tables.setdefault(request_id, [])
        if not table and adopted:  # a hit: its leading FREED entries were never held
            live = sum(1 for block in adopted if block != FREED)
            self.first_live[request_id] = len(adopted) - live
            self.num_cached[request_id] = len(adopted)
        table.extend(new_blocks)
        self.last_new[request_id] = new_blocks
        self.peak_request_blocks = max(self.peak_request_blocks, len(table) - self.first_live.get(request_id, 0))

    def release_out_of_window(self, request_id: str, next_position: int) -> None:
        """Blocks no query at ``next_position`` or later can read go back (window groups)."""

    def settle(self, request_id: str) -> None:
        """The request's previous step ran: what it left pending is settled (recurrent-state
        snapshots become findable; the pages a hit's state was copied from are let go)."""

    def cache_full_blocks(self, request: Request, num_total_tokens: int) -> None:
        """Register the blocks that this step fills, so later requests can share them."""
        if not self.caches_blocks:
            return
        table = self.tables[request.request_id]
        full = min(num_total_tokens // self.block_size, len(request.block_hashes), len(table))
        start = self.num_cached.get(request.request_id, 0)
        for index in range(start, full):
            if table[index] != FREED:
                self.pool.cache(table[index], self.key(request.block_hashes[index]))
        self.num_cached[request.request_id] = max(start, full)

    def forget_hashes_from(self, request_id: str, first_block: int) -> set[int]:
        """Make the request's blocks from ``first_block`` on unfindable (their contents are suspect)."""
        suspect = set()
        for block_id in self.tables.get(request_id, [])[first_block:]:
            if block_id != FREED:
                self.pool.forget_hash(block_id)
                suspect.add(block_id)
        return suspect

    def free(self, request_id: str) -> None:
        live = self.live(request_id)
        for mapping in (self.tables, self.num_cached, self.first_live, self.last_new):
            mapping.pop(request_id, None)
        if live:
            # Tail blocks first: a prefix's head is shared more often, so it is evicted last.
            self.pool.free(live[::-1])

    def stats(self) -> dict:
        """The group's description (made once: EngineStats asks every step) and live figures."""
        return {**self._description, "used_blocks": self.used_blocks, "peak_request_blocks": self.peak_request_blocks}


class FullAttentionManager(GroupManager):
    pass


class SlidingWindowManager(GroupManager):
    def __init__(self, spec: KVGroupSpec, pool: BlockPool, block_size: int):
        super().__init__(spec, pool, block_size)
        self.window = spec.kind.window

    def hit_lengths(self, hashes: list[bytes]) -> list[bool]:
        """A hit of ``k`` blocks needs blocks ``first_visible_block(k * size) .. k - 1`` here
        (the window of the first query it leaves to compute)."""
        cached = [self.pool.lookup(self.key(block_hash)) is not None for block_hash in hashes]
        return window_hit_lengths(cached, self.window, self.block_size)

    def hit_entries(self, hashes: list[bytes]) -> list[int]:
        first = first_visible_block(len(hashes) * self.block_size, self.window, self.block_size)
        return [FREED] * first + [self.pool.lookup(self.key(block_hash)) for block_hash in hashes[first:]]

    def release_out_of_window(self, request_id: str, next_position: int) -> None:
        table = self.tables.get(request_id)
        if not table:
            return
        first = self.first_live.get(request_id, 0)
        dead = min(first_visible_block(next_position, self.window, self.block_size), len(table))
        if dead <= first:
            return
        # Oldest first: the least likely to start another request's hit is evicted first.
        self.pool.free(table[first:dead])
        table[first:dead] = [FREED] * (dead - first)
        self.first_live[request_id] = dead


class WholeRequestManager(GroupManager):
    """Cross-attention K/V or recurrent state: the whole table at the first allocation."""

    caches_blocks = False

    def request_blocks(self, request: Request) -> int:
        if isinstance(self.spec.kind, CrossAttention):
            return blocks_needed(request.num_cross_tokens, self.block_size)
        return self.spec.blocks_per_request

    def hit_lengths(self, hashes: list[bytes]) -> list[bool]:
        # Cross K/V are derived again from the encoder output by the hit's first chunk, so
        # any hit serves.
        return [True] * (len(hashes) + 1)

    def hit_entries(self, hashes: list[bytes]) -> list[int]:
        return []

    def blocks_wanted(self, request: Request, num_total_tokens: int, adopted: list[int]) -> int:
        return 0 if request.request_id in self.tables else self.request_blocks(request)

    def take(self, request: Request, count: int) -> list[int]:
        return self.pool.allocate_run(count, self.spec.index)

    def grow(self, request: Request, num_total_tokens: int, adopted: list[int], count: int) -> None:
        if request.request_id in self.tables:
            self.last_new[request.request_id] = []
            return
        super().grow(request, num_total_tokens, [], count)


class RecurrentStateManager(WholeRequestManager):
    """A linear-attention group: each request's state pages, and snapshots of the state at
    its snapshot positions for later requests' prefix hits (D105).

    A snapshot is ``blocks_per_request`` pages taken with the allocation of the chunk that
    ends at the position; the runner copies the state into them once that chunk has run.
    They become findable (key: the group, the hash of the block that ends at the position,
    and the page's index) only when the request's next allocation shows the step ran (or it
    finished), never before: a request admitted in the same step cannot start from a copy not
    yet made. A hit takes a reference on the snapshot's pages until its copy is made."""

    def __init__(self, spec: KVGroupSpec, pool: BlockPool, block_size: int, avoid_inside_items: bool = False):
        super().__init__(spec, pool, block_size)
        self.avoid_inside_items = avoid_inside_items
        self.positions: dict[str, tuple[int, ...]] = {}
        # Request id -> (pages, their keys; None: a hit's source, let go without caching).
        self.pending: dict[str, list[tuple[list[int], list[tuple[int, bytes]] | None]]] = {}
        self.last_snapshot: dict[str, list[int]] = {}
        # Set by the coordinator while it plans an allocation without snapshots (a snapshot
        # is an optimisation: a pool short of its pages takes none rather than preempt).
        self.snapshots_off = False

    def page_keys(self, block_hash: bytes) -> list[tuple[int, bytes]]:
        return [self.key(block_hash + index.to_bytes(4, "little")) for index in range(self.spec.blocks_per_request)]

    def snapshot_positions(self, request: Request) -> tuple[int, ...]:
        positions = self.positions.get(request.request_id)
        if positions is None:
            spans = [(item.offset, item.end) for item in request.mm_items if item.length]
            positions = snapshot_positions(spans, request.num_prompt_tokens, self.block_size, self.avoid_inside_items)
            self.positions[request.request_id] = positions
        return positions

    def snapshot_due(self, request: Request, num_total_tokens: int) -> bool:
        """Whether a chunk ending at ``num_total_tokens`` ends at a snapshot position whose
        snapshot nobody has made yet."""
        if (self.snapshots_off or not self.pool.enable_caching
                or num_total_tokens not in self.snapshot_positions(request)):
            return False
        block = num_total_tokens // self.block_size - 1
        if block >= len(request.block_hashes):
            return False
        return any(self.pool.lookup(key) is None for key in self.page_keys(request.block_hashes[block]))

    def hit_lengths(self, hashes: list[bytes]) -> list[bool]:
        return [True] + [all(self.pool.lookup(key) is not None for key in self.page_keys(block_hash))
                         for block_hash in hashes]

    def state_source(self, hashes: list[bytes]) -> list[int]:
        """The snapshot a hit of ``len(hashes)`` blocks starts from (none for no hit)."""
        return [self.pool.lookup(key) for key in self.page_keys(hashes[-1])] if hashes else []

    def blocks_wanted(self, request: Request, num_total_tokens: int, adopted: list[int]) -> int:
        snapshot = self.spec.blocks_per_request if self.snapshot_due(request, num_total_tokens) else 0
        return super().blocks_wanted(request, num_total_tokens, adopted) + snapshot

    def grow(self, request: Request, num_total_tokens: int, adopted: list[int], count: int) -> None:
        request_id = request.request_id
        snapshot = self.spec.blocks_per_request if self.snapshot_due(request, num_total_tokens) else 0
        super().grow(request, num_total_tokens, adopted, count - snapshot)
        self.last_snapshot.pop(request_id, None)
        if snapshot:
            pages = self.pool.allocate_run(snapshot, self.spec.index)
            keys = self.page_keys(request.block_hashes[num_total_tokens // self.block_size - 1])
            self.pending.setdefault(request_id, []).append((pages, keys))
            self.last_snapshot[request_id] = pages

    def adopt_source(self, request_id: str, pages: list[int]) -> None:
        """Hold a hit's snapshot pages (referenced by the caller) until the copy is made."""
        self.pending.setdefault(request_id, []).append((pages, None))

    def settle(self, request_id: str) -> None:
        for pages, keys in self.pending.pop(request_id, []):
            for page, key in zip(pages, keys or []):
                self.pool.cache(page, key)
            self.pool.free(pages)

    def forget_hashes_from(self, request_id: str, first_block: int) -> set[int]:
        # The step did not run for this request: its snapshots were never made.
        dropped = set()
        kept = []
        for pages, keys in self.pending.pop(request_id, []):
            if keys is None:
                kept.append((pages, None))
            else:
                self.pool.free(pages)
                dropped.update(pages)
        if kept:
            self.pending[request_id] = kept
        self.last_snapshot.pop(request_id, None)
        return super().forget_hashes_from(request_id, first_block) | dropped

    def free(self, request_id: str) -> None:
        self.settle(request_id)
        self.positions.pop(request_id, None)
        self.last_snapshot.pop(request_id, None)
        super().free(request_id)


def manager_for(spec: KVGroupSpec, pool: BlockPool, block_size: int, avoid_inside_items: bool = False) -> GroupManager:
    if isinstance(spec.kind, FullAttention):
        return FullAttentionManager(spec, pool, block_size)
    if isinstance(spec.kind, SlidingWindow):
        return SlidingWindowManager(spec, pool, block_size)
    if isinstance(spec.kind, RecurrentState):
        return RecurrentStateManager(spec, pool, block_size, avoid_inside_items)
    return WholeRequestManager(spec, pool, block_size)


def window_hit_lengths(cached: list[bool], window: int, block_size: int) -> list[bool]:
    """For each prefix hit of ``k`` blocks (0 to ``len(cached)``), whether a window group can
    serve it: ``cached[i]``: block ``i`` is findable in the group; a hit of ``k`` blocks needs
    blocks ``first_visible_block(k * block_size, ...) .. k - 1`` there. No hit always serves."""
    valid = [True]
    last_missing = -1  # the last block before k that the group does not have
    for k in range(1, len(cached) + 1):
        if not cached[k - 1]:
            last_missing = k - 1
        valid.append(last_missing < first_visible_block(k * block_size, window, block_size))
    return valid
