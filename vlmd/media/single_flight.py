"""Collapse concurrent loads of the same URL into one fetch.

Two requests that name the same URL at the same time share one download and decode; a
request that comes later fetches again (the content behind a URL may change, so nothing
is kept beyond the in-flight call).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class SingleFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[Hashable, Future] = {}
        self.num_calls = 0  # calls that did the work (for tests and metrics)

    def do(self, key: Hashable, load: Callable[[], T]) -> T:
        with self._lock:
            future = self._in_flight.get(key)
            leader = future is None
            if leader:
                future = Future()
                self._in_flight[key] = future
        if not leader:
            return future.result()
        try:
            self.num_calls += 1
            value = load()
        except BaseException as exc:
            future.set_exception(exc)
            raise
        else:
            future.set_result(value)
            return value
        finally:
            with self._lock:
                del self._in_flight[key]
