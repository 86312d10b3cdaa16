"""The engine loop: on the engine thread, drains its inbox, steps the core, posts deltas to the
event loop."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import structlog

from vlmd.engine.core import EngineCore, StepMetrics
from vlmd.engine.engine_thread import EngineThread
from vlmd.errors import ENGINE_FAILED, ENGINE_REJECTED, VlmdError
from vlmd.types import EngineRequest, FinishReason, MultiModalItem, RequestDelta

log = structlog.get_logger(__name__)


@dataclass
class AddRequest:
    request: EngineRequest


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class BetweenSteps:
    """Work for the engine thread between two steps, outside any request: ``work(executor)``'s
    result (or its exception) goes to ``done``. An encoder-only server's encoder outputs and
    word timestamps' alignment run this way: on the thread that owns the model and its one
    OpenMP team, never beside a step."""

    work: Callable[[Any], Any]
    done: Future


def _run_between_steps(executor, message: BetweenSteps) -> None:
    if not message.done.set_running_or_notify_cancel():
        return  # its client left before the engine reached it
    try:
        message.done.set_result(message.work(executor))
    except Exception as exc:  # the client's to hear about; the engine goes on
        message.done.set_exception(exc)


def encode_to_wire(executor, items: list[MultiModalItem]) -> dict:
    """``{identifier: WireTensor}`` (vlmd/encoder_wire.py): the encoder outputs of ``items``."""
    from vlmd.processing.encoder_tensors import to_wire  # torch: the engine thread's, never the loop's

    encode = getattr(executor, "encode_items", None)
    if encode is None:
        raise RuntimeError("this executor does not serve encoder outputs (one rank only)")
    return {item.identifier: to_wire(item.modality, output) for item, output in zip(items, encode(items))}


def align_tokens(executor, query) -> Any:
    """The model's alignment for ``query`` (``vlmd.processing.speech.AlignmentQuery``)."""
    align = getattr(executor, "align_tokens", None)
    if align is None:
        raise RuntimeError("this executor does not align tokens (one rank only)")
    return align(query.item, query.token_ids, query.first_row, query.num_frames)


class EngineWorker:
    def __init__(
        self,
        core: EngineCore,
        post_deltas: Callable[[list[RequestDelta]], None],
        torch_threads: int | None = None,
        observe_step: Callable[[StepMetrics], None] | None = None,
        thread: EngineThread | None = None,
    ):
        """``thread``: the thread that built the engine (the server's, which ends it); without
        it the worker starts a thread of its own and ends it in ``stop``."""
        self.core = core
        self.post_deltas = post_deltas
        self.observe_step = observe_step
        self.torch_threads = torch_threads
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stats = core.stats()
        self._own_thread = thread is None
        self.thread = thread or EngineThread()
        self._loop: Future | None = None
        self._stopping = False

    def start(self) -> None:
        self._loop = self.thread.submit(self._run)
        self._loop.add_done_callback(_log_if_failed)

    def submit(self, message) -> None:
        self.inbox.put(message)

    def stop(self, timeout: float = 10.0) -> None:
        self.submit(Shutdown())
        if self._loop is not None:
            wait([self._loop], timeout)
        if self._own_thread:
            self.thread.close(timeout=0)

    def _run(self) -> None:
        import torch

        from vlmd.runner.device import make_current_on_this_thread

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        # This thread steps the runner: --device cuda:N must be its current device (a no-op on the CPU).
        make_current_on_this_thread(self.core.executor.device)
        while not self._stopping:
            try:
                deltas = self._drain(block=not self.core.has_work())
                if self.core.has_work() and not self._stopping:
                    deltas.extend(self._step())
            except Exception as exc:  # a bug outside the step must not strand every client
                log.exception("engine loop failed")
                deltas = self.core.fail_running(f"engine error: {type(exc).__name__}: {exc}")
            self.stats = self.core.stats()
            # Posted as the step ends: the loop streams them while this thread prepares the
            # next step (waiting for the GIL where the loop holds it), never during the
            # native step, whose team would lose a core to it (D122).
            if deltas:
                self.post_deltas(deltas)

    def _drain(self, block: bool) -> list[RequestDelta]:
        deltas: list[RequestDelta] = []
        try:
            message = self.inbox.get() if block else self.inbox.get_nowait()
            while True:
                deltas.extend(self._handle(message))
                message = self.inbox.get_nowait()
        except queue.Empty:
            pass
        return deltas

    def _handle(self, message) -> list[RequestDelta]:
        if isinstance(message, AddRequest):
            try:
                self.core.add_request(message.request)
            except Exception as exc:  # a limit only the engine knows is still the client's (400)
                status = ENGINE_REJECTED if isinstance(exc, VlmdError) else ENGINE_FAILED
                if status == ENGINE_FAILED:
                    log.exception("adding a request failed", request_id=message.request.request_id)
                return [RequestDelta(message.request.request_id, [], FinishReason.ERROR, error=str(exc),
                                     error_status=status)]
            return []
        if isinstance(message, AbortRequests):
            return self.core.abort(message.request_ids)
        if isinstance(message, BetweenSteps):
            _run_between_steps(self.core.executor, message)
            return []
        if isinstance(message, Shutdown):
            self._stopping = True
        return []

    def _step(self) -> list[RequestDelta]:
        try:
            deltas, progressed = self.core.step()
        except Exception as exc:  # the step's own failures are isolated in core.step; this is the scheduler
            log.exception("engine step failed outside the model")
            return self.core.fail_running(f"engine error: {type(exc).__name__}: {exc}")
        if not progressed and not deltas:
            time.sleep(0.001)  # waiting for room (blocks, encoder cache): don't spin hot
        elif self.observe_step is not None:
            self.observe_step(self.core.last_step_metrics)
        return deltas


def _log_if_failed(loop: Future) -> None:
    if not loop.cancelled() and loop.exception() is not None:
        log.error("engine loop ended", exc_info=loop.exception())
