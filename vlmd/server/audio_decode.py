"""Decoding the windows of one upload: every window at once, each up its temperature ladder.

A window's prompt (and its features) is built once; each decode is one engine request on
it. For a model with temperature fallback (Whisper) a window also gets one no-speech probe
request (one step, beside its first decode) and each decode asks for processed log-probs,
so it can be judged as openai-whisper judges it (``processing/temperature_fallback.py``):
a decode that fails the thresholds is followed by one at the next temperature; the last
one is kept. Windows do not wait for each other: a window that falls back decodes again
while the others finish or go on.
"""

from __future__ import annotations

import asyncio
import math
from contextlib import aclosing
from dataclasses import dataclass

from vlmd.errors import ServerError, from_engine
from vlmd.processing.base import ProcessorOutput
from vlmd.processing.temperature_fallback import FallbackThresholds, WindowDecode, temperature_ladder
from vlmd.server.state import ServerState
from vlmd.types import EngineRequest, FinishReason


@dataclass(frozen=True)
class DecodeSettings:
    """What every window of one upload is decoded with."""

    base_id: str
    temperature: float
    seed: int | None
    thresholds: FallbackThresholds
    fallback: bool  # judge each decode, go up the ladder, read the no-speech probability


async def decode_tokens(state: ServerState, request: EngineRequest) -> tuple[list[int], list[float]]:
    """One request's output tokens (end of text dropped) and the log-probs of every sampled
    token (the end of text's included, as openai-whisper's average counts it)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    async with aclosing(state.engine.generate(request)) as stream:
        async for delta in stream:
            if delta.finish_reason is FinishReason.ERROR:
                raise from_engine(delta.error, delta.error_status, request.request_id)
            tokens.extend(delta.new_token_ids)
            logprobs.extend(entry.logprob for entry in delta.logprobs or ())
    if tokens and tokens[-1] in state.eos_token_ids:
        tokens.pop()
    return tokens, logprobs


async def gather_or_cancel(coroutines) -> list:
    """Run concurrently; on failure or cancellation, cancel every one (leaving generate()
    early aborts the request in the engine)."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def decode_windows(state: ServerState, prompts: list[ProcessorOutput], settings: DecodeSettings,
                         window_seconds: list[float]) -> list[WindowDecode]:
    """Every window's kept decode, in window order."""
    return await gather_or_cancel(
        _decode_window(state, index, prompt, settings, seconds)
        for index, (prompt, seconds) in enumerate(zip(prompts, window_seconds))
    )


async def _decode_window(state: ServerState, index: int, prompt: ProcessorOutput, settings: DecodeSettings,
                         seconds: float) -> WindowDecode:
    transcriber = state.transcriber
    window_id = f"{settings.base_id}-{index}"
    probe = transcriber.no_speech_request(f"{window_id}-nospeech", prompt) if settings.fallback else None
    no_speech = asyncio.ensure_future(_no_speech_prob(state, *probe)) if probe is not None else None
    ladder = temperature_ladder(settings.temperature) if settings.fallback else (settings.temperature,)
    seed = None if settings.seed is None else settings.seed + index
    try:
        for attempt, temperature in enumerate(ladder):
            request = transcriber.decode_request(
                window_id if attempt == 0 else f"{window_id}-t{attempt}", prompt, state.eos_token_ids,
                temperature=temperature, logprobs=0, seed=seed, processed_logprobs=settings.fallback,
            )
            tokens, logprobs = await decode_tokens(state, request)
            decode = WindowDecode(tokens, logprobs, temperature, _text(state, tokens, seconds),
                                  await no_speech if no_speech is not None else None, attempt + 1)
            if not (settings.fallback and decode.needs_fallback(settings.thresholds)):
                break
        return decode
    finally:
        if no_speech is not None:
            no_speech.cancel()


async def _no_speech_prob(state: ServerState, request: EngineRequest, token_id: int) -> float:
    tokens, logprobs = await decode_tokens(state, request)
    if tokens != [token_id] or len(logprobs) != 1:
        raise ServerError("the no-speech probe did not score its token", request_id=request.request_id)
    return math.exp(logprobs[0])


def _text(state: ServerState, tokens: list[int], seconds: float) -> str:
    """The window's text without timestamps, as openai-whisper measures its compression."""
    segments = state.transcriber.processor.split_segments(tokens, seconds)
    text_tokens = [token for segment in segments for token in segment.token_ids]
    return state.tokenizer.decode(text_tokens, skip_special_tokens=True).strip()
