"""Compiling constraints for requests: bounded in time, in work waiting, and shared.

A compile runs in the grammar library's native code, which cannot be interrupted; what
bounds it there is the library's own fuel (``LLParserLimits``: a few seconds at worst on a
2-core host). Around it, this queue makes sure that:

- a client waits at most ``timeout_s`` (``--max-grammar-compile-s``) and then gets a 400
  naming the flag; the compile itself runs on to its fuel limit and its result is cached;
- at most ``max_pending`` distinct constraints are compiling or waiting at once, on
  ``threads`` threads of their own (never the media pool's); beyond that a new constraint
  is a 503, so a flood of distinct constraints costs the server one core, not all of them;
- a constraint that several requests wait for compiles once (single flight);
- a compile that has not started when its last waiter leaves (client gone, timeout) is
  cancelled: no work is done for nobody.

Torch-free, like the rest of the request accounting.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable

from vlmd.errors import BadRequestError, ServiceUnavailableError


class CompileQueue:
    def __init__(self, compile_fn: Callable, *, timeout_s: float, max_pending: int = 16, threads: int = 1):
        if timeout_s <= 0 or max_pending < 1 or threads < 1:
            raise ValueError("the compile queue needs a positive timeout, pending bound and thread count")
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self._compile = compile_fn
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vlmd-grammar")
        self._lock = threading.RLock()  # a done future runs its callback at once, inside join
        self._jobs: dict[Hashable, Future] = {}
        self._waiters: dict[Hashable, int] = {}
        # Counters for /metrics and tests.
        self.num_timeouts = 0
        self.num_refused = 0
        self.num_cancelled = 0

    def join(self, spec) -> Future:
        """The future compiling ``spec``: the one in flight, or a new one. Pair with ``leave``."""
        with self._lock:
            future = self._jobs.get(spec)
            if future is None:
                if len(self._jobs) >= self.max_pending:
                    self.num_refused += 1
                    raise ServiceUnavailableError(
                        f"{len(self._jobs)} structured-output constraints are compiling; retry shortly",
                        param=getattr(spec, "param", None))
                future = self._pool.submit(self._compile, spec)
                self._jobs[spec] = future
                future.add_done_callback(lambda done, key=spec: self._forget(key, done))
            self._waiters[spec] = self._waiters.get(spec, 0) + 1
            return future

    def leave(self, spec, future: Future) -> None:
        """One waiter is done with ``spec`` (answered, timed out or gone); the last one out
        cancels a compile that has not started."""
        with self._lock:
            left = self._waiters.get(spec, 1) - 1
            if left > 0:
                self._waiters[spec] = left
                return
            self._waiters.pop(spec, None)
        if not future.done() and future.cancel():
            self.num_cancelled += 1

    def timed_out(self, spec) -> BadRequestError:
        self.num_timeouts += 1
        return BadRequestError(
            f"compiling the {spec.kind} constraint took longer than {self.timeout_s:g} s "
            "(--max-grammar-compile-s); simplify it", param=spec.param)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget(self, spec, future: Future) -> None:
        with self._lock:
            if self._jobs.get(spec) is future:
                del self._jobs[spec]
