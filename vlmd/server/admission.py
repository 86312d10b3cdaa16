"""Admission and back-pressure on the event loop: who may start work, and for how long.

Bounds, each with its answer (all 503 with Retry-After: the server is healthy, only full):
- waiting work: requests whose body is being read, requests in preprocessing, and requests
  the engine has not started yet, at most ``--max-waiting-requests``, checked before a
  request's body is read;
- the preprocessing queue: at most ``--max-preprocess-queue`` requests wait for a thread;
- preprocessing time: a request may hold a thread for ``--preprocess-timeout`` seconds (the
  clock starts when a thread takes it); then the client is answered and the thread abandons
  the work at its next stage boundary (see vlmd.processing.deadline);
- decoded media in flight: ``--max-inflight-media-gb`` (vlmd.media.budget), one lease per
  request, given back when its answer is done;
- bodies being read and parsed at once: at most ``BODIES_IN_FLIGHT`` x ``--max-request-bytes``
  (by Content-Length; a body without one counts as the largest), so many large bodies
  arriving together cannot exhaust memory before any of them is looked at.
/health and /metrics pass none of these: they answer under any load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from vlmd.errors import ServiceUnavailableError
from vlmd.media.budget import MediaBudget, MediaLease
from vlmd.processing.deadline import Deadline, PreprocessTimeout

T = TypeVar("T")

BODIES_IN_FLIGHT = 4  # bodies of the largest size that may be read and parsed at once


class Admission:
    def __init__(self, pool: ThreadPoolExecutor, engine, *, threads: int, max_queue: int, max_waiting: int,
                 timeout_s: float, media_budget_bytes: int, max_body_bytes: int = 64 * 2**20):
        self.pool = pool
        self.engine = engine  # AsyncEngine: num_waiting
        self.threads = threads
        self.max_queue = max_queue
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.media = MediaBudget(media_budget_bytes)
        self.max_body_bytes = max_body_bytes
        self.body_budget_bytes = BODIES_IN_FLIGHT * max_body_bytes
        self.body_bytes = 0  # Content-Length of the bodies being read and parsed now
        self.num_reading = 0
        self.num_preprocessing = 0  # taken by a thread or queued for one
        self.num_timeouts = 0
        self.num_rejected = 0

    @property
    def num_queued(self) -> int:
        return max(0, self.num_preprocessing - self.threads)

    @property
    def num_waiting(self) -> int:
        """Admitted work not yet running: bodies being read, requests in preprocessing
        (taken or queued: both arrived before any later request), and requests the engine
        has not started."""
        return self.num_reading + self.num_preprocessing + self.engine.num_waiting

    def check_capacity(self) -> None:
        """At the door, before the body is even parsed."""
        waiting = self.num_waiting
        if waiting >= self.max_waiting:
            self.num_rejected += 1
            raise ServiceUnavailableError(
                f"the server is at capacity: {waiting} requests are waiting (--max-waiting-requests "
                f"{self.max_waiting}); retry later")

    @contextmanager
    def reading_body(self, content_length: int | None):
        """Around reading and parsing one body (on the loop)."""
        size = min(content_length if content_length is not None else self.max_body_bytes, self.max_body_bytes)
        if self.body_bytes and self.body_bytes + size > self.body_budget_bytes:
            self.num_rejected += 1
            raise ServiceUnavailableError(
                f"{self.body_bytes} bytes of request bodies are being read; this one ({size} bytes) would pass "
                f"{self.body_budget_bytes} ({BODIES_IN_FLIGHT} x --max-request-bytes): retry later")
        self.body_bytes += size
        self.num_reading += 1
        try:
            yield
        finally:
            self.body_bytes -= size
            self.num_reading -= 1

    def media_lease(self) -> MediaLease:
        return self.media.lease()

    async def preprocess(self, work: Callable[[Deadline], T]) -> T:
        """Run ``work(deadline)`` on the pool within the queue bound and the time limit."""
        if self.num_queued >= self.max_queue:
            self.num_rejected += 1
            raise ServiceUnavailableError(
                f"{self.num_queued} requests are waiting for a preprocessing thread (--max-preprocess-queue "
                f"{self.max_queue}); retry later")
        loop = asyncio.get_running_loop()
        deadline = Deadline(self.timeout_s)
        started = loop.create_future()

        def run() -> T:
            deadline.start()
            loop.call_soon_threadsafe(_set_result, started)
            deadline.check("starting")  # abandoned while queued (the client left)
            return work(deadline)

        self.num_preprocessing += 1
        job = self.pool.submit(run)
        # The thread stays taken until the work returns, even after the client was answered.
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished))
        result = asyncio.wrap_future(job)
        try:
            await asyncio.wait([started, result], return_when=asyncio.FIRST_COMPLETED)
            try:
                return await asyncio.wait_for(result, self.timeout_s)
            except TimeoutError:
                self.num_timeouts += 1
                raise deadline.error("the work was abandoned") from None
            except PreprocessTimeout:  # the thread found itself late at a stage boundary
                self.num_timeouts += 1
                raise
        finally:
            deadline.abandon()  # answered, failed or cancelled: the thread stops at its next stage
            job.cancel()  # not started yet: never starts
            started.cancel()

    def _finished(self) -> None:
        self.num_preprocessing -= 1


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
