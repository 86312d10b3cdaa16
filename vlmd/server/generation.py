"""One prompt's choices being generated: engine requests in, text deltas out.

``n`` choices are ``n`` engine requests with the same prompt, submitted together. They
share the prompt's KV blocks through the prefix cache: when the first choice is admitted,
the scheduler registers the hashes of the full blocks its chunk fills, so the next
choice's lookup (the same step, or the step the first one's prefill completes) adopts
those blocks by reference and computes only the last partial block. Each choice has its
own request id, index, seed stream (``seed + index``) and finish reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import structlog

from vlmd.errors import VlmdError, from_engine
from vlmd.server import responses
from vlmd.server.detokenizer import IncrementalDetokenizer
from vlmd.server.modality_tokens import merged_counts, multimodal_token_counts
from vlmd.server.sampling_fields import SamplingFields
from vlmd.server.stages import stage_seconds
from vlmd.server.state import ServerState
from vlmd.types import EngineRequest, EngineTimings, FinishReason, TokenLogprob

log = structlog.get_logger(__name__)


@dataclass
class Delta:
    index: int  # the choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # set on the choice's last delta


def choice_requests(
    state: ServerState, request_id: str, processed, sampling: SamplingFields, grammar=None, first_index: int = 0
) -> list[EngineRequest]:
    """The engine requests of one prompt's ``n`` choices (``processed``: a ProcessorOutput).

    ``grammar`` (compiled, immutable) is shared: each choice gets its own matcher in the runner.
    """
    num_prompt = len(processed.prompt_token_ids)
    return [
        EngineRequest(
            request_id=f"{request_id}-{first_index + choice}",
            prompt_token_ids=processed.prompt_token_ids,
            sampling=dataclasses.replace(sampling.for_choice(choice, num_prompt, state.max_model_len), grammar=grammar),
            mm_items=processed.items,
            eos_token_ids=state.eos_token_ids,
            arrival_time=time.time(),
            family_state=processed.family_state,
        )
        for choice in range(sampling.n)
    ]


class Generation:
    """Accumulates one choice's output while its deltas stream in."""

    def __init__(self, state: ServerState, engine_request: EngineRequest, sampling: SamplingFields, started: float,
                 index: int = 0, counts_prompt: bool = True, preprocess_stages=None):
        """``preprocess_stages``: the prompt's ``processing/stages.py:PreprocessStages``; with
        it, the first token's stage table is observed (by the prompt's first choice)."""
        self.state = state
        self.preprocess_stages = preprocess_stages
        self.counts_prompt = counts_prompt  # the first choice of its prompt: usage counts the prompt here
        self.started = started  # perf_counter() when the HTTP request arrived
        self.index = index
        self.engine_request = engine_request
        self.detokenizer = IncrementalDetokenizer(state.tokenizer, sampling.stop, sampling.skip_special_tokens)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.last_token_time: float | None = None

    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            async with aclosing(self._deltas()) as inner:  # closing it aborts the engine request
                async for item in inner:
                    yield item
        finally:
            log.info(
                "request finished",
                request_id=self.engine_request.request_id,
                prompt_tokens=len(self.engine_request.prompt_token_ids),
                cached_tokens=self.num_cached_tokens,
                completion_tokens=len(self.token_ids),
                media_items=len(self.engine_request.mm_items),
                finish_reason=self.finish_reason or "abort",
                seconds=round(time.perf_counter() - self.started, 4),
            )

    async def _deltas(self) -> AsyncIterator[Delta]:
        if self.counts_prompt and self.preprocess_stages is not None:
            self.preprocess_stages.wait_ends()  # its preprocessing thread's end to the engine
        async with aclosing(self.state.engine.generate(self.engine_request)) as stream:
            async for delta in stream:
                if delta.finish_reason is FinishReason.ERROR:
                    raise from_engine(delta.error, delta.error_status, self.engine_request.request_id)
                if delta.new_token_ids:
                    self._observe_latency(delta.timings)
                self.num_cached_tokens = delta.num_cached_tokens
                final = delta.finish_reason is not None
                text = self.detokenizer.push(delta.new_token_ids, final=final)
                self.text += text
                self.token_ids.extend(delta.new_token_ids)
                if delta.logprobs:
                    self.logprobs.extend(delta.logprobs)
                if self.detokenizer.stopped:
                    self.finish_reason = "stop"
                    yield Delta(self.index, text, delta.new_token_ids, delta.logprobs, "stop")
                    return  # leaving the stream aborts the request in the engine
                if final:
                    self.finish_reason = "length" if delta.finish_reason is FinishReason.LENGTH else "stop"
                yield Delta(self.index, text, delta.new_token_ids, delta.logprobs, self.finish_reason)
                if final:
                    return

    def _observe_latency(self, timings: EngineTimings | None) -> None:
        now = time.perf_counter()
        metrics = self.state.metrics
        if metrics is not None:
            if self.last_token_time is None:
                if self.counts_prompt:  # one time-to-first-token per prompt, not per choice
                    metrics.ttft.observe(now - self.started)
                    if timings is not None and self.preprocess_stages is not None:
                        self._observe_stages(timings, now)
            else:
                metrics.itl.observe(now - self.last_token_time)
        self.last_token_time = now

    def _observe_stages(self, timings: EngineTimings, now: float) -> None:
        self.preprocess_stages.wait_ends(timings.decoded_pixels_begun)  # its first token to the loop
        stages = stage_seconds(self.started, self.preprocess_stages, timings, now)
        kind = "media" if self.engine_request.mm_items else "text"
        self.state.metrics.observe_stages(stages, kind, timings.chunk_seconds)
        if self.state.config.log_request_stages:
            log.info("request stages", request_id=self.engine_request.request_id, input=kind,
                     ttft_ms=round(1000 * (now - self.started), 2), prefill_chunks=len(timings.chunk_seconds),
                     pixels_waited=self.preprocess_stages.pixels_waited,
                     **{f"{name}_ms": round(1000 * seconds, 2) for name, seconds in stages.items()})


async def merged_deltas(generations: list[Generation]) -> AsyncIterator[Delta]:
    """Every choice's deltas, interleaved as they arrive. Leaving early (a disconnect, an
    engine failure) cancels the other choices, which aborts their engine requests."""
    if len(generations) == 1:
        async with aclosing(generations[0].deltas()) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(generation: Generation) -> None:
        try:
            async with aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    queue.put_nowait(delta)
        except VlmdError as exc:
            queue.put_nowait(exc)
        queue.put_nowait(done)

    tasks = [asyncio.ensure_future(pump(generation)) for generation in generations]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, VlmdError):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(generations: list[Generation]) -> dict:
    """The prompt counted once per distinct prompt; completion tokens of every choice;
    cached tokens as found by each prompt's first choice (what earlier requests left); the
    prompts' placeholder tokens per modality."""
    prompts = [g for g in generations if g.counts_prompt]
    return responses.usage(
        sum(len(g.engine_request.prompt_token_ids) for g in prompts),
        sum(len(g.token_ids) for g in generations),
        sum(g.num_cached_tokens for g in prompts),
        merged_counts(multimodal_token_counts(g.engine_request.mm_items) for g in prompts),
    )
