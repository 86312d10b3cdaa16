"""N tensor-parallel ranks: rank 0 runs here, on the engine thread; the rest in their processes.

Each step, rank 0 broadcasts a :class:`StepMessage` (the ``SchedulerOutput`` plus the tokens
it sampled in the previous step) over the step channel, then runs its own runner; every
rank runs the same forward on its shards, meeting at the model's all-reduces; only rank 0
computes logits and samples, and only its ``RunnerOutput`` comes back.

Failure semantics (docs/architecture.md, "Tensor parallelism"):
- a local rank process that exits is seen by the watchdog within ``WATCH_S``;
- a rank on another host that dies breaks its gloo connections, and the next collective
  raises at once; one that hangs makes the next collective time out after
  ``--distributed-timeout-s``; while idle, a ping + ack every ``heartbeat_s`` keeps every
  rank's wait bounded and finds a hung rank;
- the first failure is kept in ``failure`` (naming the rank where known), logged, handed to
  the ``on_failure`` callbacks (the server turns unhealthy and exits non-zero), and every
  ``execute`` from then on raises :class:`RankFailure`, so in-flight requests get errors.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import structlog

from vlmd.distributed.channel import Kind, StepChannel
from vlmd.distributed.world import bind_thread
from vlmd.engine.executor import RankFailure
from vlmd.sched.kv_spec import KVCacheConfig
from vlmd.sched.output import RunnerOutput, SchedulerOutput

log = structlog.get_logger(__name__)

WATCH_S = 0.2


@dataclass
class StepMessage:
    """One run of the model, as every other rank must repeat it."""

    # The step's SchedulerOutput when this is its first run (the ranks apply its bookkeeping
    # first); None for a re-run of the same step (engine/isolation.py): they reuse the last.
    out: SchedulerOutput | None
    request_ids: list[str]  # whose chunks run (all of the step's, or a subset); may be empty
    # Tokens rank 0 sampled since the last message: the other ranks append them first, so
    # every rank builds the same batch.
    sampled: dict[str, int] = field(default_factory=dict)
    # A re-run only: rank 0's computed-token counts of these requests (its failed run did
    # not advance them; another rank's may have, if only rank 0's sampling raised).
    num_computed_tokens: dict[str, int] | None = None


def for_other_ranks(message: StepMessage) -> StepMessage:
    """The message without what only rank 0 uses: a request's compiled grammar (only rank 0
    samples; the library's matcher is no plain data and stays off the wire, D92)."""
    out = message.out
    if out is None or not any(data.sampling.grammar is not None for data in out.new_requests):
        return message
    new_requests = [replace(data, sampling=replace(data.sampling, grammar=None)) if data.sampling.grammar is not None
                    else data for data in out.new_requests]
    return replace(message, out=replace(out, new_requests=new_requests))


@dataclass
class StartupPlan:
    """What rank 0 decides after loading and every rank must agree on."""

    kv_cache: KVCacheConfig  # the pool and its groups (sched/kv_spec.py), the same on every rank
    kv_spec: tuple[int, int, int]  # (layers, kv heads per rank, head dim): checked by each rank
    seed: int


def is_collective_error(exc: BaseException) -> bool:
    """gloo and NCCL report a lost or silent peer as a RuntimeError from their C++ code."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(mark in text for mark in ("gloo", "NCCL", "Connection closed by peer"))


class MultiprocExecutor:
    def __init__(self, runner, channel: StepChannel, processes, timeout_s: float, cores: list[int] | None = None,
                 process_mask: set[int] | None = None):
        """``processes``: :class:`vlmd.engine.rank_launcher.RankProcesses` of this host's other
        ranks (None when all of them are on other hosts). ``process_mask``: the process's
        cores (the caller's own mask when not given: it may be pinned already)."""
        self.runner = runner
        self.channel = channel
        self.processes = processes
        self.timeout_s = timeout_s
        self.heartbeat_s = max(0.5, min(5.0, timeout_s / 4))
        self.failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()  # one collective sequence at a time: steps and pings
        self._sampled: dict[str, int] = {}
        self._pending: SchedulerOutput | None = None  # applied here, not yet sent
        self._last_message = time.monotonic()
        self._cores = cores
        self._process_mask = process_mask or os.sched_getaffinity(0)
        self._bound_thread: int | None = None
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._heartbeat, name="vlmd-tp-heartbeat", daemon=True),
            threading.Thread(target=self._watch, name="vlmd-tp-watchdog", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ---- the engine thread's calls ------------------------------------------------

    def apply_schedule(self, out: SchedulerOutput) -> None:
        """Rank 0 applies it now; the others with the step's first run (one message), or at
        once when the step runs nothing (requests dropped, encoder outputs evicted)."""
        self.runner.apply_schedule(out)
        self._pending = out
        if out.is_empty:
            self._bind_caller()
            with self._lock:
                self._send(StepMessage(out, []))

    def run(self, out: SchedulerOutput, request_ids: list[str]) -> RunnerOutput:
        first = self._pending is out
        computed = None if first else {rid: self.runner.requests[rid].num_computed_tokens for rid in request_ids}
        self._bind_caller()
        # Held through the forward: a ping between two of its all-reduces would desynchronise
        # the ranks' sequences of collectives.
        with self._lock:
            self._send(StepMessage(out if first else None, request_ids, num_computed_tokens=computed))
            try:
                result = self.runner.run(out, request_ids)
            except Exception as exc:
                if is_collective_error(exc):
                    raise RankFailure(self._fail_from(exc)) from None
                raise  # the model's own error: every rank raised it at the same point
            finally:
                self._last_message = time.monotonic()
        self._sampled.update(result.sampled_token_ids)
        return result

    def _send(self, message: StepMessage) -> None:
        """Under the lock."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        message.sampled, self._sampled = self._sampled, {}
        self._pending = None
        try:
            self.channel.send(Kind.STEP, for_other_ranks(message))
        except Exception as exc:
            raise RankFailure(self._fail_from(exc)) from None
        finally:
            self._last_message = time.monotonic()

    @property
    def encoder_outputs(self) -> dict:
        return self.runner.encoder_outputs

    @property
    def device(self):
        return self.runner.device

    @property
    def num_encoder_forwards(self) -> int:
        return self.runner.num_encoder_forwards

    @property
    def num_encoder_calls(self) -> int:
        return self.runner.num_encoder_calls

    @property
    def decode_steps(self) -> dict[str, int]:  # rank 0's: every rank takes the same path
        return dict(self.runner.attention.decode_steps)

    @property
    def step_channel_stats(self):
        return self.channel.stats

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def shutdown(self) -> None:
        """End every rank: a SHUTDOWN message when they can hear it, then terminate."""
        self._stopping.set()
        if self.failure is None and self._lock.acquire(timeout=2.0):
            try:
                self.channel.send(Kind.SHUTDOWN)
            except Exception as exc:  # already gone: the processes are ended below anyway
                log.warning("tensor-parallel shutdown message failed", error=str(exc)[:200])
            finally:
                self._lock.release()
        if self.processes is not None:  # after a failure nobody is listening: no grace
            self.processes.stop(grace_s=10.0 if self.failure is None else 0.0)
        if self.failure is None:
            from vlmd.distributed.world import leave_world

            leave_world()

    # ---- failure detection --------------------------------------------------------

    def _fail(self, message: str) -> str:
        with _FAIL_LOCK:
            if self.failure is not None:
                return self.failure
            self.failure = message
        log.error("tensor-parallel rank failed; the server stops", reason=message)
        for callback in self._callbacks:
            try:
                callback(message)
            except Exception:
                log.exception("failure callback raised")
        return message

    def _fail_from(self, exc: BaseException) -> str:
        """A collective broke: name the dead local rank if the watchdog can find one."""
        deadline = time.monotonic() + 1.0
        while self.processes is not None and time.monotonic() < deadline:
            dead = self.processes.first_exited()
            if dead is not None:
                return self._fail(dead)
            time.sleep(0.05)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "Timed out" in first_line or "timed out" in first_line:
            reason = f"a tensor-parallel rank did not answer within {self.timeout_s:g} s (hung or unreachable)"
        else:
            reason = "a tensor-parallel rank's connection was lost (the rank died or its host is unreachable)"
        return self._fail(f"{reason}: {first_line[:300]}")

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_S):
            if self.failure is not None or self.processes is None:
                continue
            dead = self.processes.first_exited()
            if dead is not None:
                self._fail(dead)

    def _heartbeat(self) -> None:
        """While idle: ping + ack, so no rank's wait runs into the timeout and a hung one is found."""
        while not self._stopping.wait(self.heartbeat_s / 2):
            if self.failure is not None or time.monotonic() - self._last_message < self.heartbeat_s:
                continue
            if not self._lock.acquire(blocking=False):
                continue  # a step is running: it is traffic enough
            try:
                if self._stopping.is_set() or self.failure is not None:
                    continue
                self.channel.send(Kind.PING)
                self.channel.ack()
            except Exception as exc:
                self._fail_from(exc)
            finally:
                self._last_message = time.monotonic()
                self._lock.release()

    def _bind_caller(self) -> None:
        """Pin whichever thread runs rank 0's steps to rank 0's cores (the server's engine
        thread is pinned from the start, ``tp_startup.pin_engine_thread``; another caller,
        e.g. a test's, is pinned here and the thread pinned before gets its mask back)."""
        tid = threading.get_native_id()
        if self._cores is None or tid == self._bound_thread:
            return
        if self._bound_thread is not None:
            try:
                bind_thread(sorted(self._process_mask), self._bound_thread)
            except OSError:
                pass  # that thread has ended
        bind_thread(self._cores)
        self._bound_thread = tid


_FAIL_LOCK = threading.Lock()
