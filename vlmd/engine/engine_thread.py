"""The engine thread: the one thread of a server process that runs torch's parallel ops.

torch's CPU ops fork and join an OpenMP team for every op big enough to split, and libgomp
gives each thread that enters a parallel region a team of its own, whose threads live on.
Once libgomp's threads outnumber the CPUs it stops spinning between regions (its "throttled"
spin count, ~100 spins) and parks its threads in the kernel, so every op of every later step
pays futex wake-ups. Building the engine on the main thread and stepping it on another was
enough: a small-LLaVA decode step took 18.5 ms in a process whose only team was the
stepping thread's, and 25-26 ms once one other thread had run a single parallel op (AMD EPYC
fam 25 model 17, 2 vCPUs; `docs/architecture.md`, "One OpenMP team per process").

So the engine is built (weights, kernel choices, memory profile, warm-up) and stepped on this
one thread, and every other thread that may touch torch (the media pool) runs its ops on
itself alone (`single_threaded_torch`): a team of one starts no threads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread that runs the callables it is given, one after another, in order."""

    def __init__(self, name: str = "vlmd-engine"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future:
        """Run ``fn`` on the engine thread after what was submitted before; its future."""
        future: Future = Future()
        self._calls.put((fn, future))
        return future

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread and wait: its result, or its exception raised here."""
        return self.submit(fn).result()

    def close(self, timeout: float | None = None) -> None:
        """End the thread once what was submitted has run (waiting at most ``timeout``)."""
        self._calls.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            fn, future = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, which decides
                future.set_exception(exc)


def single_threaded_torch() -> None:
    """A thread-pool initializer: torch ops on this thread run on it alone (no OpenMP team).

    ``torch.set_num_threads`` sets this thread's OpenMP and MKL thread counts, and the default
    of threads that have not run a torch op yet; the engine thread set its own before.
    """
    import torch

    torch.set_num_threads(1)
