"""Token-slot accounting for encoder outputs, shared across requests.

The scheduler decides here whether an item may be encoded this step and when its output
may be dropped; the runner holds the tensors and drops the identifiers this manager
reports as evicted. Capacity is in encoder output tokens, not bytes, so the scheduler
needs no knowledge of hidden sizes or dtypes.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, cache_size: int):
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        # Free slots plus slots held by outputs that no request uses any more.
        self.num_freeable_slots = cache_size
        self._users: dict[str, set[str]] = {}  # identifier -> request ids holding it
        self._sizes: dict[str, int] = {}
        self._unused: OrderedDict[str, int] = OrderedDict()  # resident, no users: LRU
        self._evicted: list[str] = []
        self.num_queries = 0
        self.num_hits = 0

    def is_resident(self, identifier: str) -> bool:
        return identifier in self._sizes

    def acquire_if_resident(self, request_id: str, identifier: str) -> bool:
        """Take a reference on an already computed (or scheduled) output."""
        if identifier not in self._sizes:
            return False
        users = self._users.setdefault(identifier, set())
        if not users and identifier in self._unused:
            self.num_freeable_slots -= self._unused.pop(identifier)
        users.add(request_id)
        return True

    def record_lookups(self, num_queries: int, num_hits: int) -> None:
        """Count lookups once, for a chunk that was scheduled (not for plans dropped)."""
        self.num_queries += num_queries
        self.num_hits += num_hits

    def can_allocate(self, num_tokens: int, encoder_budget: int, pending_tokens: int) -> bool:
        """Whether an item of ``num_tokens`` fits this step's budget and the cache.

        ``pending_tokens`` are slots already promised this step but not yet allocated.
        Evicts unused outputs (oldest first) when that makes room.
        """
        if num_tokens > encoder_budget:
            return False
        needed = num_tokens + pending_tokens
        if needed > self.num_freeable_slots:
            return False
        while needed > self.num_free_slots:
            identifier, size = self._unused.popitem(last=False)
            del self._sizes[identifier]
            self._users.pop(identifier, None)
            self._evicted.append(identifier)
            self.num_free_slots += size
        return True

    def allocate(self, request_id: str, identifier: str, num_tokens: int) -> None:
        self._sizes[identifier] = num_tokens
        self._users[identifier] = {request_id}
        self.num_free_slots -= num_tokens
        self.num_freeable_slots -= num_tokens

    def release(self, request_id: str, identifier: str) -> None:
        """Drop a request's reference; the output stays resident until evicted."""
        users = self._users.get(identifier)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            size = self._sizes[identifier]
            self._unused[identifier] = size
            self.num_freeable_slots += size

    def forget(self, identifier: str) -> None:
        """Drop an output that was allocated but never computed (its encoder raised), users
        or not, so nobody later takes it for resident; the runner is told to drop it too."""
        size = self._sizes.pop(identifier, None)
        if size is None:
            return
        if identifier in self._unused:
            del self._unused[identifier]  # already counted as freeable
        else:
            self.num_freeable_slots += size
        self._users.pop(identifier, None)
        self.num_free_slots += size
        self._evicted.append(identifier)

    def take_evicted(self) -> list[str]:
        evicted, self._evicted = self._evicted, []
        return evicted

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_slots / self.cache_size if self.cache_size else 0.0
