"""The engine core: one scheduler, one executor, one step at a time (worker thread only)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vlmd.engine.executor import Executor
from vlmd.sched.output import SchedulerOutput
from vlmd.sched.scheduler import Scheduler
from vlmd.types import EngineRequest, FinishReason, RequestDelta


@dataclass
class EngineStats:
    """A snapshot the front end may read at any time (replaced, never mutated)."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    num_encoder_forwards: int = 0
    encoder_cache_usage: float = 0.0
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found in the prefix cache
    num_steps: int = 0


@dataclass
class StepMetrics:
    """Timings of one step, for histograms on the front end."""

    encoder_seconds: float = 0.0
    queue_seconds: list[float] = field(default_factory=list)  # requests admitted for the first time


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor):
        self.scheduler = scheduler
        self.executor = executor  # the only way to the model (engine/executor.py)
        self.num_steps = 0
        self.last_step_metrics = StepMetrics()

    def add_request(self, request: EngineRequest) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> list[RequestDelta]:
        return self.scheduler.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> tuple[list[RequestDelta], bool]:
        """Run one step; returns the deltas and whether any tokens were computed."""
        out: SchedulerOutput = self.scheduler.schedule()
        now = time.time()
        queued = [
            now - request.arrival_time
            for data in out.new_requests
            if (request := self.scheduler.requests.get(data.request_id)) is not None
            and request.num_preemptions == 0
            and request.arrival_time
        ]
        result = self.executor.execute(out)
        self.num_steps += 1
        self.last_step_metrics = StepMetrics(result.encoder_seconds if out.scheduled_encoder_inputs else 0.0, queued)
        return self.scheduler.update_from_output(out, result), not out.is_empty

    def fail_running(self, message: str) -> list[RequestDelta]:
        """After a runner error: end every request in flight with an error, keep serving."""
        ids = [r.request_id for r in self.scheduler.running] + [r.request_id for r in self.scheduler.waiting]
        self.scheduler.abort_requests(ids)
        return [RequestDelta(rid, [], FinishReason.ERROR, error=message) for rid in ids]

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=kv.pool.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            kv_usage=kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_encoder_forwards=self.executor.num_encoder_forwards,
            encoder_cache_usage=self.scheduler.encoder_cache.usage,
            encoder_cache_queries=self.scheduler.encoder_cache.num_queries,
            encoder_cache_hits=self.scheduler.encoder_cache.num_hits,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_steps=self.num_steps,
        )
