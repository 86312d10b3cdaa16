"""POST /v1/audio/transcriptions and /v1/audio/translations (OpenAI's multipart API).

The upload is decoded and cut into windows of at most 30 s (at quiet points) on the
preprocessing pool. A model that detects languages, asked without a ``language``, first
detects it on the first window. Every window then becomes one engine request (the family's
whole generation prompt for it, built on the pool), all submitted at once, so the windows
of one upload (and of other uploads) are batched together; the texts are joined in window
order and segment times are offset by each window's start. A Whisper window whose decode
fails openai-whisper's thresholds is decoded again at a higher temperature
(``audio_decode.py``). ``stream`` sends text deltas as server-sent events
(``transcript.text.delta`` then ``transcript.text.done``), window by window in order while
later windows decode in the background; each window is decoded once there. Word timestamps
(``timestamp_granularities[]=word``): once a window is decoded, the engine aligns its tokens
to its audio (the model's cross-attention, one pass on the engine thread) and the pool turns
that alignment into timed words.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing

import orjson
import structlog
from aiohttp import web

from vlmd.errors import BadRequestError, ServerError, VlmdError, from_engine
from vlmd.processing.speech import TimedWord, TranscriptionOptions
from vlmd.processing.temperature_fallback import WindowDecode
from vlmd.server.audio_decode import DecodeSettings, decode_tokens, decode_windows, gather_or_cancel
from vlmd.server.audio_form import (FORM_FIELDS_BYTES, THRESHOLD_FIELDS, TranscriptionForm, max_form_bytes,
                                   read_transcription_form)
from vlmd.server.body import within_read_deadline
from vlmd.server.detokenizer import IncrementalDetokenizer
from vlmd.server.request_fields import model_not_found
from vlmd.server.state import ServerState
from vlmd.server.transcript_formats import Segment, join_texts, render, usage
from vlmd.types import EngineRequest, FinishReason

log = structlog.get_logger(__name__)


async def transcriptions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "transcribe")


async def translations(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "translate")


async def _handle(request: web.Request, task: str) -> web.StreamResponse:
    state: ServerState = request.app["state"]
    transcriber = state.transcriber
    if transcriber is None:
        raise BadRequestError(
            f"the model `{state.config.model_name}` does not take audio; /v1/audio/* needs a speech-to-text model",
            param="model",
        )
    max_file_bytes = transcriber.policy.max_audio_bytes
    # 413 at once past the form's bound, 503 past capacity, both before the upload is read.
    with state.admission.reading_body(request.content_length, max_form_bytes(max_file_bytes),
                                      f"max_bytes {max_file_bytes} for the audio file and {FORM_FIELDS_BYTES} for the other fields") as account:
        form = await within_read_deadline(request, read_transcription_form(request, max_file_bytes, account))
    if form.model != state.config.model_name:
        raise model_not_found(form.model)
    options = TranscriptionOptions(task=task, language=form.language, prompt=form.prompt, timestamps=form.timestamps,
                                   words=form.words)
    transcriber.check(options)
    if form.words and state.config.tensor_parallel_size > 1:
        # The alignment pass reads every head of a layer; under tensor parallelism each rank holds some.
        raise BadRequestError("word timestamps need the whole decoder on one rank: not under --tensor-parallel-size",
                              param="timestamp_granularities")
    if form.thresholds_given and not transcriber.processor.temperature_fallback:
        raise BadRequestError("this model has no temperature fallback: drop the *_threshold fields",
                              param=next(name for name in THRESHOLD_FIELDS if name in form.given_fields))
    started = time.perf_counter()
    prepared = await state.admission.preprocess(lambda deadline: transcriber.prepare(form.file, options))
    with state.admission.media_lease() as lease:  # the windows' samples, until the answer is done
        lease.hold(sum(window.samples.nbytes for window in prepared.windows), "the audio")
        return await _transcribe(request, state, form, options, prepared, task, started)


async def window_prompts(state: ServerState, prepared, options: TranscriptionOptions, base_id: str):
    """The language (detected on the first window when the model detects languages and none
    was given) and every window's prompt, built on the pool (each computes its features).
    An engine error propagates (the HTTP routes' middleware, the realtime session's events)."""
    transcriber = state.transcriber
    language = options.language
    if language is None and transcriber.multilingual:
        language = await _detect_language(state, transcriber, prepared.windows[0], base_id)

    def build():
        return [transcriber.window_prompt(window, options, language) for window in prepared.windows]

    return language, await asyncio.get_running_loop().run_in_executor(state.pool, build)


def transcript_text(decodes: list[WindowDecode], settings: DecodeSettings) -> str:
    """The windows' texts joined in order, a window judged silent left out: the ``text`` of
    a json answer (and of a realtime item once committed)."""
    return join_texts([decode.text for decode in decodes
                       if not (settings.fallback and decode.is_silence(settings.thresholds))])


async def _transcribe(request, state: ServerState, form: TranscriptionForm, options, prepared, task: str, started):
    transcriber = state.transcriber
    base_id = f"trsc-{uuid.uuid4().hex}"
    language, prompts = await window_prompts(state, prepared, options, base_id)
    if form.stream:
        requests = [
            transcriber.decode_request(f"{base_id}-{index}", prompt, state.eos_token_ids, temperature=form.temperature,
                                       seed=None if form.seed is None else form.seed + index)
            for index, prompt in enumerate(prompts)
        ]
        return await _stream(request, state, form, requests, prepared.duration)
    settings = DecodeSettings(base_id, form.temperature, form.seed, form.thresholds,
                              fallback=transcriber.processor.temperature_fallback)
    decodes = await decode_windows(state, prompts, settings, [w.end - w.start for w in prepared.windows])
    text, segments = _assemble(state, transcriber, prepared, decodes, form, settings)
    words = await _time_words(state, prepared, prompts, decodes, settings, language) if form.words else None
    language_name = transcriber.processor.language_name(language)
    body, content_type = render(form.response_format, text, segments, task=task, language=language_name,
                                duration=prepared.duration, words=words, list_segments=form.segments)
    log.info("transcription finished", request_id=base_id, windows=len(prepared.windows),
             decodes=sum(decode.attempts for decode in decodes),
             audio_seconds=round(prepared.duration, 2), seconds=round(time.perf_counter() - started, 3))
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _detect_language(state: ServerState, transcriber, window, base_id: str) -> str:
    request = await asyncio.get_running_loop().run_in_executor(state.pool, transcriber.detection_request, f"{base_id}-language", window)
    tokens, _ = await decode_tokens(state, request)
    if not tokens:
        raise ServerError("language detection produced no token", request_id=base_id)
    return transcriber.language_of(tokens[0])


def _assemble(state: ServerState, transcriber, prepared, decodes: list[WindowDecode], form: TranscriptionForm,
              settings: DecodeSettings) -> tuple[str, list[Segment]]:
    """The text and segments of the windows in order; a window judged silent has none."""
    if not form.timestamps:
        return transcript_text(decodes, settings), []
    kept = [(window, decode) for window, decode in zip(prepared.windows, decodes)
            if not (settings.fallback and decode.is_silence(settings.thresholds))]
    decode_text = state.tokenizer.decode
    segments: list[Segment] = []
    for window, decode in kept:
        for timed in transcriber.segments(decode.tokens, window):
            segments.append(Segment(
                timed.start, timed.end, decode_text(timed.token_ids, skip_special_tokens=True), timed.token_ids,
                seek=int(round(window.start * 100)), temperature=decode.temperature,
                avg_logprob=decode.avg_logprob, compression_ratio=decode.compression_ratio,
                no_speech_prob=decode.no_speech_prob,
            ))
    return join_texts([segment.text for segment in segments]), segments


async def _time_words(state: ServerState, prepared, prompts, decodes: list[WindowDecode], settings: DecodeSettings,
                      language: str | None) -> list[TimedWord]:
    """The words of the windows ``_assemble`` keeps, in order: each window's tokens aligned
    by the engine (its prompt and features as decoded), then warped and grouped on the pool."""
    transcriber = state.transcriber
    loop = asyncio.get_running_loop()

    async def window_words(window, prompt, decode: WindowDecode) -> list[TimedWord]:
        if not decode.tokens:
            return []
        alignment = await state.engine.align(transcriber.alignment_query(window, prompt, decode.tokens))
        return await loop.run_in_executor(state.pool, transcriber.words, decode.tokens, alignment, window, language)

    per_window = await gather_or_cancel(
        window_words(window, prompt, decode) for window, prompt, decode in zip(prepared.windows, prompts, decodes)
        if not (settings.fallback and decode.is_silence(settings.thresholds))
    )
    return [word for words in per_window for word in words]


class _TextJoiner:
    """Streamed pieces whose concatenation equals ``join_texts`` of the window texts."""

    def __init__(self):
        self.text = ""
        self._held = ""  # trailing whitespace, released only if text follows
        self._window_started = False

    def push(self, piece: str) -> str:
        prefix = ""
        if not self._window_started:
            piece = piece.lstrip()
            if not piece:
                return ""
            self._window_started = True
            prefix = " " if self.text else ""
        full = self._held + piece
        kept = full.rstrip()
        self._held = full[len(kept):]
        delta = prefix + kept
        self.text += delta
        return delta

    def end_window(self) -> None:
        self._held, self._window_started = "", False


async def _stream_window(state: ServerState, request: EngineRequest, queue: asyncio.Queue) -> None:
    detokenizer = IncrementalDetokenizer(state.tokenizer)
    try:
        async with aclosing(state.engine.generate(request)) as stream:
            async for delta in stream:
                if delta.finish_reason is FinishReason.ERROR:
                    raise from_engine(delta.error, delta.error_status, request.request_id)
                text = detokenizer.push(delta.new_token_ids, final=delta.finish_reason is not None)
                if text:
                    queue.put_nowait(text)
        queue.put_nowait(None)
    except VlmdError as exc:
        queue.put_nowait(exc)


async def _stream(request: web.Request, state: ServerState, form: TranscriptionForm, requests, duration: float):
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(body: dict) -> None:
        await response.write(b"data: " + orjson.dumps(body) + b"\n\n")

    queues = [asyncio.Queue() for _ in requests]
    tasks = [asyncio.ensure_future(_stream_window(state, r, q)) for r, q in zip(requests, queues)]
    joiner = _TextJoiner()
    try:
        try:
            for queue in queues:  # windows in order; later ones keep decoding meanwhile
                while (piece := await queue.get()) is not None:
                    if isinstance(piece, VlmdError):
                        raise piece
                    delta = joiner.push(piece)
                    if delta:
                        await send({"type": "transcript.text.delta", "delta": delta})
                joiner.end_window()
            await send({"type": "transcript.text.done", "text": joiner.text, "usage": usage(duration)})
        except VlmdError as exc:  # the status line is sent: the error goes in the stream
            await send(exc.to_dict())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left mid-stream: a normal abort
        log.info("client disconnected during the stream", request_id=requests[0].request_id if requests else None)
    finally:
        for task in tasks:
            task.cancel()
    return response
