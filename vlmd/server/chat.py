"""POST /v1/chat/completions: preprocess on the pool, generate, answer as JSON or SSE."""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing

import orjson
import structlog
from aiohttp import web

from vlmd.errors import BadRequestError, NotFoundError, VlmdError, from_engine
from vlmd.server import responses
from vlmd.server.body import read_body
from vlmd.server.detokenizer import IncrementalDetokenizer
from vlmd.server.protocol import ChatCompletionRequest, parse_chat_request
from vlmd.server.state import ServerState
from vlmd.types import EngineRequest, FinishReason

log = structlog.get_logger(__name__)


async def read_json(request: web.Request, max_run_bytes: int | None = None, describe: str = ""):
    raw = await read_body(request, max_run_bytes, describe)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from None


class _Generation:
    """Accumulates one request's output while its deltas stream in."""

    def __init__(
        self, state: ServerState, chat: ChatCompletionRequest, engine_request: EngineRequest, started: float
    ):
        self.state = state
        self.started = started  # perf_counter() when the HTTP request arrived
        self.chat = chat
        self.engine_request = engine_request
        self.detokenizer = IncrementalDetokenizer(state.tokenizer, chat.stop, chat.skip_special_tokens)
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.last_token_time: float | None = None

    async def deltas(self):
        """Yield (text, new token ids, new logprob entries) as they become available."""
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

    async def _deltas(self):
        async with aclosing(self.state.engine.generate(self.engine_request)) as stream:
            async for delta in stream:
                if delta.finish_reason is FinishReason.ERROR:
                    raise from_engine(delta.error, delta.error_status, self.engine_request.request_id)
                if delta.new_token_ids:
                    self._observe_latency()
                self.num_cached_tokens = delta.num_cached_tokens
                final = delta.finish_reason is not None
                text = self.detokenizer.push(delta.new_token_ids, final=final)
                self.token_ids.extend(delta.new_token_ids)
                if delta.logprobs:
                    self.logprobs.extend(delta.logprobs)
                if self.detokenizer.stopped:
                    self.finish_reason = "stop"
                    yield text, delta.new_token_ids, delta.logprobs
                    return  # leaving the stream aborts the request in the engine
                if final:
                    self.finish_reason = "length" if delta.finish_reason is FinishReason.LENGTH else "stop"
                yield text, delta.new_token_ids, delta.logprobs
                if final:
                    return

    def _observe_latency(self) -> None:
        now = time.perf_counter()
        metrics = self.state.metrics
        if metrics is not None:
            if self.last_token_time is None:
                metrics.ttft.observe(now - self.started)
            else:
                metrics.itl.observe(now - self.last_token_time)
        self.last_token_time = now

    def usage(self) -> dict:
        return responses.usage(len(self.engine_request.prompt_token_ids), len(self.token_ids), self.num_cached_tokens)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    state: ServerState = request.app["state"]
    state.admission.check_capacity()  # 503 before the body is parsed
    preprocessor = state.preprocessor
    with state.admission.reading_body(request.content_length):
        # A run of 12 bytes per character (a surrogate pair's escapes) past the character
        # bound is refused while the body streams in, before any copy or parse.
        chat = parse_chat_request(await read_json(
            request, 12 * preprocessor.max_prompt_chars,
            f"its text has more than {preprocessor.max_prompt_chars} characters: more than "
            f"max_model_len ({preprocessor.max_model_len}) tokens can hold "
            f"({preprocessor.max_token_chars} characters per token at most)"))
    if chat.model != state.config.model_name:
        raise NotFoundError(f"The model `{chat.model}` does not exist.", param="model", code="model_not_found")
    vocab_size = state.preprocessor.vocab_size
    out_of_range = [t for t in chat.stop_token_ids if t >= vocab_size]
    if out_of_range:  # the sampler would index its logits with them and fail the whole batch
        raise BadRequestError(
            f"stop_token_ids must be below the vocabulary size {vocab_size}, got {out_of_range[0]}",
            param="stop_token_ids",
        )
    state.preprocessor.check_text_length(chat.messages)  # 400 before a thread is taken
    with state.admission.media_lease() as lease:  # decoded media held until the answer is done
        return await _generate(request, state, chat, started, lease)


async def _generate(request: web.Request, state: ServerState, chat: ChatCompletionRequest, started: float, lease):
    processed = await state.admission.preprocess(
        lambda deadline: state.preprocessor.process_chat(chat.messages, chat.mm_processor_kwargs, deadline, lease)
    )
    num_prompt = len(processed.prompt_token_ids)
    sampling = chat.sampling_params(num_prompt, state.max_model_len)
    engine_request = EngineRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        prompt_token_ids=processed.prompt_token_ids,
        sampling=sampling,
        mm_items=processed.items,
        eos_token_ids=state.eos_token_ids,
        arrival_time=time.time(),
        mrope_positions=processed.mrope_positions,
        mrope_position_delta=processed.mrope_position_delta,
    )
    generation = _Generation(state, chat, engine_request, started)
    if chat.stream:
        return await _stream(request, state, chat, generation)
    return await _complete(state, chat, generation)


async def _complete(state: ServerState, chat: ChatCompletionRequest, generation: _Generation) -> web.Response:
    text_parts = []
    async for text, _, _ in generation.deltas():  # an engine error propagates: 400 or 500
        text_parts.append(text)
    request_id = generation.engine_request.request_id
    body = responses.completion(
        request_id,
        int(time.time()),
        state.config.model_name,
        "".join(text_parts),
        generation.finish_reason or "stop",
        generation.usage(),
        generation.token_ids if chat.return_token_ids else None,
        generation.engine_request.prompt_token_ids if chat.return_token_ids else None,
        responses.logprobs_content(state.tokenizer, generation.logprobs) if chat.logprobs else None,
    )
    return web.json_response(body, dumps=_dumps)


async def _stream(request: web.Request, state: ServerState, chat: ChatCompletionRequest, generation: _Generation):
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    request_id = generation.engine_request.request_id
    created = int(time.time())
    model = state.config.model_name

    async def send(body: dict) -> None:
        await response.write(b"data: " + orjson.dumps(body) + b"\n\n")

    first_extra = {"prompt_token_ids": generation.engine_request.prompt_token_ids} if chat.return_token_ids else {}
    try:
        await send(responses.chunk(request_id, created, model, {"role": "assistant", "content": ""}, **first_extra))
        try:
            async for text, token_ids, logprobs in generation.deltas():
                finish = generation.finish_reason
                if not text and not finish and not chat.return_token_ids and not chat.logprobs:
                    continue
                await send(
                    responses.chunk(
                        request_id, created, model, {"content": text} if text else {}, finish,
                        token_ids=list(token_ids) if chat.return_token_ids else None,
                        logprobs=responses.logprobs_content(state.tokenizer, logprobs or []) if chat.logprobs else None,
                    )
                )
        except VlmdError as exc:  # the status line is sent: the error goes in the stream
            await send(exc.to_dict())
        else:
            if chat.include_usage:
                await send(responses.usage_chunk(request_id, created, model, generation.usage()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left mid-stream: a normal abort, not a server error
        log.info("client disconnected during the stream", request_id=request_id)
    return response


def _dumps(body) -> str:
    return orjson.dumps(body).decode()


__all__ = ["chat_completions", "read_json", "VlmdError"]
