"""The engine core: one scheduler, one executor, one step at a time (worker thread only)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog

from vlmd.engine.executor import Executor, RankFailure
from vlmd.engine.isolation import find_culprits
from vlmd.errors import ENGINE_FAILED
from vlmd.sched.output import RunnerOutput, SchedulerOutput
from vlmd.sched.scheduler import Scheduler
from vlmd.types import EngineRequest, EngineTimings, FinishReason, RequestDelta
from vlmd.media.image import DECODED_PIXELS

log = structlog.get_logger(__name__)


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
    num_encoder_calls: int = 0  # encoder invocations (a step's items of one modality go in one)
    encoder_cache_usage: float = 0.0
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found in the prefix cache
    num_steps: int = 0
    num_failed_steps: int = 0  # steps that raised and were re-run without their culprits
    num_requests_failed: int = 0  # requests a failed step was traced to
    num_prompt_tokens: int = 0  # prompt tokens of every request added (placeholders included)
    decode_steps: dict[str, int] = field(default_factory=dict)  # steps of decodes alone, by path
    # Per KV group (sched/kv_spec.py; the blocks above are the one pool they share): group,
    # kind, layers, window (a sliding window's), used_blocks, peak_request_blocks
    # (KVCacheManager.group_stats).
    kv_groups: list[dict] = field(default_factory=list)


@dataclass
class StepMetrics:
    """Timings of one step, for histograms on the front end."""

    encoder_seconds: float = 0.0
    queue_seconds: list[float] = field(default_factory=list)  # requests admitted for the first time
    # Scheduling, model and output handling of a step that computed tokens; its kind is
    # "decode" when every chunk was one token and no encoder ran, else "prefill". Why: a
    # workload's time splits into compute-bound prefill steps and bandwidth-bound decode
    # steps, whose floors differ (contrib/bench/roofline.py reads the split from /metrics).
    step_seconds: float = 0.0
    kind: str = ""


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor):
        self.scheduler = scheduler
        self.executor = executor  # the only way to the model (engine/executor.py)
        self.num_steps = 0
        self.num_failed_steps = 0
        self.num_requests_failed = 0
        self.num_prompt_tokens = 0
        self.last_step_metrics = StepMetrics()
        # Requests that have no first token yet: where their engine time goes (given with it).
        self.timings: dict[str, EngineTimings] = {}

    def add_request(self, request: EngineRequest) -> None:
        self.scheduler.add_request(request)
        self.num_prompt_tokens += len(request.prompt_token_ids)
        self.timings[request.request_id] = EngineTimings(handed=request.handed_time)

    def abort(self, request_ids: list[str]) -> list[RequestDelta]:
        for request_id in request_ids:
            self.timings.pop(request_id, None)
        return self.scheduler.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> tuple[list[RequestDelta], bool]:
        """Run one step; returns the deltas and whether any tokens were computed.

        When the step raises, only the request(s) that made it raise fail: ``find_culprits``
        re-runs the step's chunks without suspects until every innocent chunk has run, and
        the innocent requests continue as if nothing happened (the scheduler's accounting
        for them already describes the step; the re-runs rewrote the same KV slots).
        """
        started = time.perf_counter()
        out: SchedulerOutput = self.scheduler.schedule()
        now = time.time()
        queued = [
            now - request.arrival_time
            for data in out.new_requests
            if (request := self.scheduler.requests.get(data.request_id)) is not None
            and request.num_preemptions == 0
            and request.arrival_time
        ]
        self.executor.apply_schedule(out)
        deltas: list[RequestDelta] = []
        if out.is_empty:
            result = RunnerOutput()
        else:
            try:
                result = self.executor.run(out, list(out.num_scheduled_tokens))
            except RankFailure:
                raise  # no request caused it and none can run: every one fails (engine/worker.py)
            except Exception as exc:
                self.num_failed_steps += 1
                log.warning("engine step failed; re-running it to find the request that caused it",
                            error=f"{type(exc).__name__}: {exc}", requests=len(out.num_scheduled_tokens))
                result, culprits = find_culprits(self.executor, out, exc)
                deltas = self._fail_culprits(out, culprits)
        self.num_steps += 1
        ended = time.perf_counter()
        if not out.is_empty:
            self._time_chunks(out, result, started, ended)
        deltas += self.scheduler.update_from_output(out, result)
        self._give_timings(deltas, ended)
        decode_only = not out.scheduled_encoder_inputs and all(n == 1 for n in out.num_scheduled_tokens.values())
        self.last_step_metrics = StepMetrics(
            result.encoder_seconds if out.scheduled_encoder_inputs else 0.0, queued,
            step_seconds=time.perf_counter() - started if not out.is_empty else 0.0,
            kind="" if out.is_empty else "decode" if decode_only else "prefill")
        return deltas, not out.is_empty

    def _time_chunks(self, out: SchedulerOutput, result: RunnerOutput, started: float, ended: float) -> None:
        """A step's time to each request it ran a chunk of before its first token; of it, the
        step's encoder work (whoever's items it encoded: what the chunk waited for)."""
        encoder_seconds = result.encoder_seconds if out.scheduled_encoder_inputs else 0.0
        for request_id in out.num_scheduled_tokens:
            timings = self.timings.get(request_id)
            if timings is None:
                continue
            if not timings.first_scheduled:
                timings.first_scheduled = started
            timings.chunk_seconds.append(ended - started)
            timings.encoder_seconds += encoder_seconds

    def _give_timings(self, deltas: list[RequestDelta], ended: float) -> None:
        """Each first token's delta carries its request's timings; an ended request's go."""
        for delta in deltas:
            if delta.new_token_ids:
                timings = self.timings.pop(delta.request_id, None)
                if timings is not None:
                    timings.first_token = ended
                    timings.decoded_pixels_begun = DECODED_PIXELS.begun
                    delta.timings = timings
            elif delta.finish_reason is not None:
                self.timings.pop(delta.request_id, None)

    def _fail_culprits(self, out: SchedulerOutput, culprits: dict[str, BaseException]) -> list[RequestDelta]:
        """End the requests a failed step was traced to, and undo what their chunk left behind."""
        for request_id, exc in culprits.items():
            log.error("request failed in an engine step", request_id=request_id, exc_info=exc)
        self.num_requests_failed += len(culprits)
        # Encoder outputs that were to be computed for them and never were: forget them, or a
        # later request with the same item would find them "resident" and fail too.
        missing = {
            self.scheduler.requests[rid].mm_items[index].identifier
            for rid in culprits
            for index in out.scheduled_encoder_inputs.get(rid, ())
        } - set(self.executor.encoder_outputs)
        messages = {
            rid: f"the engine failed while computing this request ({type(exc).__name__})"
            for rid, exc in culprits.items()
        }
        tainted = self.scheduler.fail_requests(messages, out.num_scheduled_tokens)
        self.scheduler.forget_encoder_outputs(missing)
        for request_id in tainted:  # adopted a culprit's unwritten prefix block this step
            log.warning("request recomputes: it shared a failed request's prefix blocks", request_id=request_id)
        return [
            RequestDelta(rid, [], FinishReason.ERROR, error=message, error_status=ENGINE_FAILED)
            for rid, message in messages.items()
        ]

    def fail_running(self, message: str) -> list[RequestDelta]:
        """After an error outside a step (the scheduler itself): end every request in
        flight with an error, keep serving."""
        ids = [r.request_id for r in self.scheduler.running] + [r.request_id for r in self.scheduler.waiting]
        self.scheduler.abort_requests(ids)
        self.timings.clear()
        return [RequestDelta(rid, [], FinishReason.ERROR, error=message, error_status=ENGINE_FAILED) for rid in ids]

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
            num_encoder_calls=self.executor.num_encoder_calls,
            decode_steps=self.executor.decode_steps,
            encoder_cache_usage=self.scheduler.encoder_cache.usage,
            encoder_cache_queries=self.scheduler.encoder_cache.num_queries,
            encoder_cache_hits=self.scheduler.encoder_cache.num_hits,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_steps=self.num_steps,
            num_failed_steps=self.num_failed_steps,
            num_requests_failed=self.num_requests_failed,
            num_prompt_tokens=self.num_prompt_tokens,
            kv_groups=kv.group_stats(),
        )
