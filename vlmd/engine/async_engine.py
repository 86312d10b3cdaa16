"""The event-loop side of the engine: submit requests, stream their deltas, abort."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future

from vlmd.engine.worker import AbortRequests, AddRequest, BetweenSteps, EngineWorker, align_tokens, encode_to_wire
from vlmd.types import EngineRequest, MultiModalItem, RequestDelta


class AsyncEngine:
    """Bridges the worker thread and asyncio: one queue per request, one callback per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.worker: EngineWorker | None = None
        self._streams: dict[str, asyncio.Queue] = {}

    def attach(self, worker: EngineWorker) -> None:
        self.worker = worker

    def post_deltas(self, deltas: list[RequestDelta]) -> None:
        """Called on the worker thread."""
        self.loop.call_soon_threadsafe(self._dispatch, deltas)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put_nowait(delta)

    @property
    def stats(self):
        return self.worker.stats

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running: in the inbox or the scheduler's queue."""
        return max(0, len(self._streams) - self.worker.stats.num_running)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """Yield the request's deltas until it finishes; leaving early aborts it."""
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = stream
        request.handed_time = time.perf_counter()  # its engine stages start here (EngineTimings)
        self.worker.submit(AddRequest(request))
        finished = False
        try:
            while True:
                delta = await stream.get()
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.worker.submit(AbortRequests([request.request_id]))

    async def encode(self, items: list[MultiModalItem]) -> dict:
        """The encoder outputs of ``items`` by identifier (``WireTensor``s), computed on the
        engine thread between steps; a client that leaves first cancels work not yet begun."""
        done: Future = Future()
        self.worker.submit(BetweenSteps(lambda executor: encode_to_wire(executor, items), done))
        return await asyncio.wrap_future(done)

    async def align(self, query):
        """The model's alignment of a decoded window's tokens to its audio
        (``vlmd.processing.speech.AlignmentQuery``; word timestamps), on the engine thread
        between steps; a client that leaves first cancels work not yet begun."""
        done: Future = Future()
        self.worker.submit(BetweenSteps(lambda executor: align_tokens(executor, query), done))
        return await asyncio.wrap_future(done)
