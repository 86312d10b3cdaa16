"""Admission and back-pressure on the event loop: who may start work, and for how long.

Bounds, each with its answer (all 503 with Retry-After: the server is healthy, only full):
- waiting work: requests whose body is being read, requests in preprocessing, and requests
  the engine has not started yet, at most ``--max-waiting-requests``, checked before a
  request's body is read;
- the preprocessing queue: at most ``--max-preprocess-queue`` requests wait for a thread;
  work with media may hold all threads but one (of two or more), so a request without
  media never waits behind media work for a thread (D110);
- preprocessing time: a request may hold a thread for ``--preprocess-timeout`` seconds (the
  clock starts when a thread takes it); then the client is answered and the thread abandons
  the work at its next stage boundary (see vlmd.processing.deadline);
- decoded media in flight: ``--max-inflight-media-gb`` (vlmd.media.budget), one lease per
  request, given back when its answer is done;
- a body's size: a declared Content-Length past the route's bound is a 413 at once, before
  anything is reserved or read; a body that streams past it is a 413 when it does;
- bodies being read and parsed at once: at most ``BODIES_IN_FLIGHT`` x ``--max-request-bytes``
  of bytes *received* (charged as they arrive, D97), so many large bodies arriving together
  cannot exhaust memory before any of them is looked at, while uploads that declare a size
  and send nothing hold no share of it: they cost their own connection and read deadline,
  never another client's request.
/health and /metrics pass none of these: they answer under any load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from vlmd.errors import PayloadTooLargeError, ServiceUnavailableError
from vlmd.media.budget import MediaBudget, MediaLease
from vlmd.processing.deadline import Deadline, PreprocessTimeout
from vlmd.processing.stages import PreprocessStages

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
        # Threads media work may hold at once: all but one, kept for work without media.
        self.media_threads = max(1, threads - 1)
        self._media_slots = asyncio.Semaphore(self.media_threads)

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
    def reading_body(self, content_length: int | None, bound: int, describe_bound: str):
        """Around reading and parsing one body (on the loop); yields its ``BodyAccount``,
        which the reader tells the bytes received so far. ``bound``: the route's largest
        body, named by ``describe_bound`` in the 413. Before anything is read: a declared
        length past ``bound`` is a 413 (on its word: nothing reserved, nothing read; aiohttp
        discards what follows), then the door's capacity (503)."""
        if content_length is not None and content_length > bound:
            raise PayloadTooLargeError(
                f"the request body declares {content_length} bytes (Content-Length); the limit is {bound} bytes "
                f"({describe_bound})")
        self.check_capacity()
        account = BodyAccount(self, bound, describe_bound)
        self.num_reading += 1
        try:
            yield account
        finally:
            self.body_bytes -= account.charged
            self.num_reading -= 1

    def media_lease(self) -> MediaLease:
        return self.media.lease()

    async def preprocess(self, work: Callable[[Deadline], T], stages: PreprocessStages | None = None,
                         media: bool = True) -> T:
        """Run ``work(deadline)`` on the pool within the queue bound and the time limit;
        ``stages`` is stamped when it is handed to the pool, taken by a thread and done.
        ``media``: the work fetches, decodes or processes media (or may: audio, the encoder
        route), and waits for one of ``media_threads``; work without media (text to
        template and tokenize) goes to the pool at once, where a thread is free for it."""
        if self.num_queued >= self.max_queue:
            self.num_rejected += 1
            raise ServiceUnavailableError(
                f"{self.num_queued} requests are waiting for a preprocessing thread (--max-preprocess-queue "
                f"{self.max_queue}); retry later")
        loop = asyncio.get_running_loop()
        deadline = Deadline(self.timeout_s)
        started = loop.create_future()

        def run() -> T:
            if stages is not None:
                stages.started = time.perf_counter()
                stages.wait_ends()  # the pool's queue
            deadline.start()
            loop.call_soon_threadsafe(_set_result, started)
            deadline.check("starting")  # abandoned while queued (the client left)
            result = work(deadline)
            if stages is not None:
                stages.ended = time.perf_counter()
                stages.wait_begins()  # for the loop, to the engine (Generation ends it)
            return result

        if stages is not None:
            stages.submitted = time.perf_counter()
            stages.wait_ends()  # from its arrival (the front end's work and turns of the loop)
            stages.wait_begins()
        self.num_preprocessing += 1
        if media:
            try:
                await self._media_slots.acquire()
            except BaseException:  # the client left while it waited
                self.num_preprocessing -= 1
                raise
        job = self.pool.submit(run)
        # The thread stays taken until the work returns, even after the client was answered.
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished, media))
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

    def _finished(self, media: bool) -> None:
        self.num_preprocessing -= 1
        if media:
            self._media_slots.release()


class BodyAccount:
    """One body's share of the bodies-in-flight budget: the bytes it has received so far,
    charged as they arrive. A body alone is always admitted (it is at most its route's
    bound); beside others it is a 503 once the bytes all of them received would pass
    ``BODIES_IN_FLIGHT`` x ``--max-request-bytes``."""

    def __init__(self, admission: Admission, bound: int, describe_bound: str):
        self.admission = admission
        self.bound = bound
        self.describe_bound = describe_bound
        self.charged = 0

    def received(self, total_bytes: int) -> None:
        """The body has received ``total_bytes`` bytes in all (its own count, never less than
        before): 413 past the route's bound, 503 past the shared budget."""
        if total_bytes > self.bound:
            raise PayloadTooLargeError(
                f"the request body is larger than the limit of {self.bound} bytes ({self.describe_bound})")
        more = total_bytes - self.charged
        if more <= 0:
            return
        admission = self.admission
        others = admission.body_bytes - self.charged
        if others and admission.body_bytes + more > admission.body_budget_bytes:
            admission.num_rejected += 1
            raise ServiceUnavailableError(
                f"{others} bytes of other request bodies are being read; this one's {total_bytes} would pass "
                f"{admission.body_budget_bytes} ({BODIES_IN_FLIGHT} x --max-request-bytes): retry later")
        admission.body_bytes += more
        self.charged = total_bytes


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
