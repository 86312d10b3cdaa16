"""An LRU bounded by bytes, safe to share between threads: the processor cache and the
decoded-image memo are both one (a value counts the bytes its owner says it takes)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.queries = 0
        self.hits = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: K) -> V | None:
        """The value, now the most recently used; None (a miss) when absent."""
        with self._lock:
            self.queries += 1
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put_sized(self, key: K, value: V, size: int) -> None:
        """Keep ``value`` (replacing one under ``key``), evicting least recently used first."""
        if size > self.capacity_bytes:
            return  # larger than the whole cache: keeping it would evict everything
        with self._lock:
            previous = self._entries.pop(key, None)
            if previous is not None:
                self._bytes -= previous[1]
            self._entries[key] = (value, size)
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted
