"""Which KV blocks each request holds, per KV group, and prefix-cache hits for new requests.

The main group (the full-attention layers, or every layer of a model without windows) is
the table every request has always had. A window group (``kv_groups.py``) has its own pool
and tables; its blocks that the request's window has left behind are given back as the
request advances (``release_out_of_window``), their entries kept as ``FREED``. An
encoder-decoder's cross-attention layers have a pool of their own (``cross_kv.py``): a
request's cross table is taken whole with its first allocation and freed with the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vlmd.sched.block_hash import extend_block_hashes
from vlmd.sched.block_pool import BlockPool, blocks_needed
from vlmd.sched.cross_kv import CrossPool
from vlmd.sched.kv_groups import FREED, WindowGroup, first_visible_block, window_hit_lengths
from vlmd.sched.request import Request


@dataclass
class PrefixHit:
    """Cached blocks a request adopts at admission: the main group's leading run and, for
    each window group, the entries of the same length (``FREED`` before the window)."""

    blocks: list[int] = field(default_factory=list)
    windows: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class _Group:
    """One pool and every request's table in it (``window`` None: the main group)."""

    def __init__(self, window: int | None, num_blocks: int, caching: bool):
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        self.tables: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}  # leading entries already registered by hash
        self.first_live: dict[str, int] = {}  # entries before it are FREED (window groups)
        self.last_new: dict[str, list[int]] = {}  # what the last allocation appended
        self.peak_request_blocks = 0  # the most blocks one request has held here at once

    def live(self, request_id: str) -> list[int]:
        table = self.tables.get(request_id, [])
        return table[self.first_live.get(request_id, 0):]


class KVCacheManager:
    """Maps requests to block ids and grows their tables as they get longer."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window_groups: Sequence[WindowGroup] = (), cross_blocks: int = 0):
        """``cross_blocks``: the cross-attention pool's size (0: the model has no cross-attention)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._main = _Group(None, num_blocks, enable_prefix_caching)
        self._windows = [_Group(group.window, group.num_blocks, enable_prefix_caching) for group in window_groups]
        if len({group.window for group in self._windows}) != len(self._windows):
            raise ValueError(f"two KV groups with one window: {list(window_groups)}")
        self._groups = [self._main, *self._windows]
        self.pool = self._main.pool
        self.cross = CrossPool(cross_blocks) if cross_blocks else None
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return self._main.tables.get(request_id, [])

    def window_block_ids(self, request_id: str) -> dict[int, list[int]]:
        """Each window group's table of the request (``FREED`` where given back), copied."""
        return {group.window: list(group.tables.get(request_id, [])) for group in self._windows}

    def new_window_blocks(self, request_id: str) -> dict[int, list[int]]:
        """What the last ``allocate_slots`` of the request appended to each window table."""
        return {group.window: list(group.last_new.get(request_id, [])) for group in self._windows}

    def window_stats(self) -> list[dict]:
        """Per window group: its pool, the blocks requests hold now, the most one request held."""
        return [{"window": group.window, "num_blocks": group.pool.num_blocks,
                 "used_blocks": group.pool.num_blocks - group.pool.num_free_blocks,
                 "peak_request_blocks": group.peak_request_blocks} for group in self._windows]

    def cross_block_ids(self, request_id: str) -> list[int]:
        """The request's cross-attention table (empty: none, or no cross pool), copied."""
        return list(self.cross.tables.get(request_id, [])) if self.cross is not None else []

    def cross_blocks_needed(self, request: Request) -> int:
        """Cross-attention blocks the request's items need (0 without a cross pool)."""
        return blocks_needed(request.num_cross_tokens, self.block_size) if self.cross is not None else 0

    def cross_stats(self) -> dict | None:
        """The cross pool: its size, the blocks requests hold now, the most one request held."""
        if self.cross is None:
            return None
        return {"num_blocks": self.cross.num_blocks, "used_blocks": self.cross.num_used_blocks,
                "peak_request_blocks": self.cross.peak_request_blocks}

    def computed_blocks(self, request: Request) -> PrefixHit:
        """The longest run of cached blocks that starts the request's tokens and that every
        group can serve: a window group needs the blocks of the window before the hit's end
        (else a shorter hit where it has them, or none).

        At least the last token is always left to compute: its logits are needed.
        """
        if not self.enable_prefix_caching:
            return PrefixHit()
        self._update_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:limit]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        hashes = request.block_hashes[:len(hits)]
        valid = [True] * (len(hits) + 1)
        for group in self._windows:
            cached = [group.pool.lookup(block_hash) is not None for block_hash in hashes]
            valid = [a and b for a, b in zip(valid, window_hit_lengths(cached, group.window, self.block_size))]
        length = max(k for k, ok in enumerate(valid) if ok)
        windows = {}
        for group in self._windows:
            first = first_visible_block(length * self.block_size, group.window, self.block_size)
            windows[group.window] = [FREED] * first + [group.pool.lookup(h) for h in hashes[first:length]]
        return PrefixHit(hits[:length], windows)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once, when its request is admitted (not at every retry)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_total_tokens: int, computed: PrefixHit | None = None) -> list[int] | None:
        """Grow the request's tables to hold ``num_total_tokens``; None if blocks run out in
        any group (then nothing is taken).

        A request without a cross table yet (first scheduled, or resumed after preemption)
        takes its whole table in the cross pool too, or waits with nothing taken.
        ``computed``: a prefix hit to adopt first (a request being admitted). Window blocks
        the request's next query (``request.num_computed_tokens``) cannot see are given back
        first. Returns only the main group's newly added block ids (the runner appends them;
        ``new_window_blocks`` has the window groups').
        """
        request_id = request.request_id
        computed = computed or PrefixHit()
        if self._windows:
            self.release_out_of_window(request_id, request.num_computed_tokens)
        needed = blocks_needed(num_total_tokens, self.block_size)
        plans = []
        for group in self._groups:
            adopted = computed.blocks if group is self._main else computed.windows.get(group.window, [])
            live_hits = [block for block in adopted if block != FREED]
            missing = needed - len(group.tables.get(request_id, [])) - len(adopted)
            # Hit blocks that nobody holds sit on the free list: they cannot also be new blocks.
            if missing > group.pool.num_free_blocks - group.pool.count_unreferenced(live_hits):
                return None
            plans.append((group, adopted, live_hits, missing))
        cross_missing = 0
        if self.cross is not None and request_id not in self.cross.tables:
            cross_missing = self.cross_blocks_needed(request)
            if not self.cross.can_allocate(cross_missing):
                return None
        if cross_missing:
            self.cross.allocate(request_id, cross_missing)
        for group, adopted, live_hits, missing in plans:
            group.pool.touch(live_hits)
            new_blocks = adopted + group.pool.allocate(max(missing, 0))
            table = group.tables.setdefault(request_id, [])
            if not table and adopted:  # a hit: its leading FREED entries were never held
                group.first_live[request_id] = len(adopted) - len(live_hits)
                group.num_cached[request_id] = len(adopted)
            table.extend(new_blocks)
            group.last_new[request_id] = new_blocks
            if group.window is not None:
                held = len(table) - group.first_live.get(request_id, 0)
                group.peak_request_blocks = max(group.peak_request_blocks, held)
            self._cache_full_blocks(group, request, num_total_tokens)
        return self._main.last_new[request_id]

    def release_out_of_window(self, request_id: str, next_position: int) -> None:
        """Give back each window group's blocks that no query at ``next_position`` or later
        can read (the scheduler calls this for every running request before allocating)."""
        for group in self._windows:
            table = group.tables.get(request_id)
            if not table:
                continue
            first = group.first_live.get(request_id, 0)
            dead = min(first_visible_block(next_position, group.window, self.block_size), len(table))
            if dead <= first:
                continue
            # Oldest first: the least likely to start another request's hit is evicted first.
            group.pool.free(table[first:dead])
            table[first:dead] = [FREED] * (dead - first)
            group.first_live[request_id] = dead

    def _cache_full_blocks(self, group: _Group, request: Request, num_total_tokens: int) -> None:
        """Register the blocks that this step fills, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        table = group.tables[request.request_id]
        full = min(num_total_tokens // self.block_size, len(request.block_hashes))
        start = group.num_cached.get(request.request_id, 0)
        for index in range(start, full):
            if table[index] != FREED:
                group.pool.cache(table[index], request.block_hashes[index])
        group.num_cached[request.request_id] = max(start, full)

    def _update_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, request.mm_items, self.block_size)

    def forget_hashes_from(self, request_id: str, first_block: int) -> set[tuple[int | None, int]]:
        """Make the request's blocks from ``first_block`` on unfindable by prefix hash (their
        contents are suspect), in every group; returns them as (window, block id) keys."""
        suspect = set()
        for group in self._groups:
            for block_id in group.tables.get(request_id, [])[first_block:]:
                if block_id != FREED:
                    group.pool.forget_hash(block_id)
                    suspect.add((group.window, block_id))
        return suspect

    def held_blocks(self, request_id: str) -> set[tuple[int | None, int]]:
        """The request's blocks in every group, as (window, block id) keys."""
        return {(group.window, block_id) for group in self._groups for block_id in group.live(request_id)}

    def free(self, request_id: str) -> None:
        if self.cross is not None:
            self.cross.free(request_id)
        for group in self._groups:
            live = group.live(request_id)
            for mapping in (group.tables, group.num_cached, group.first_live, group.last_new):
                mapping.pop(request_id, None)
            if live:
                # Tail blocks first: a prefix's head is shared more often, so it is evicted last.
                group.pool.free(live[::-1])
