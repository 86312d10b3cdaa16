"""POST /v1/chat/completions: preprocess on the pool, generate, answer as JSON or SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing

import orjson
import structlog
from aiohttp import web

from vlmd.errors import BadRequestError, VlmdError
from vlmd.processing.stages import PreprocessStages
from vlmd.server import responses
from vlmd.server.admission import BodyAccount
from vlmd.server.body import read_body
from vlmd.server.generation import Generation, choice_requests, merged_deltas, usage
from vlmd.server.protocol import ChatCompletionRequest, parse_chat_request
from vlmd.server.request_fields import model_not_found
from vlmd.server.state import ServerState
from vlmd.server.structured_output import compile_structured_output

log = structlog.get_logger(__name__)


async def read_json(request: web.Request, account: BodyAccount, max_run_bytes: int | None = None,
                    describe: str = "", max_values: int | None = None):
    raw = await read_body(request, account, max_run_bytes, describe, max_values)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from None


async def read_text_body(request: web.Request, state: ServerState):
    """The JSON body of a text front door, under the admission bounds: 413 at once for a
    declared length past --max-request-bytes; 503 past --max-waiting-requests before it is
    read, or past the bodies-in-flight budget as it arrives (D97); a run of 12 bytes per character (a surrogate
    pair's escapes) past the character bound is refused while it streams in, before any copy
    or parse."""
    with state.admission.reading_body(request.content_length, state.config.max_request_bytes,
                                      "--max-request-bytes") as account:
        preprocessor = state.preprocessor
        return await read_json(
            request, account, 12 * preprocessor.max_prompt_chars,
            f"its text has more than {preprocessor.max_prompt_chars} characters: more than "
            f"max_model_len ({preprocessor.max_model_len}) tokens can hold "
            f"({preprocessor.max_token_chars} characters per token at most)",
            state.config.max_request_json_values)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    stages = PreprocessStages()  # from its arrival (D109, D116)
    state: ServerState = request.app["state"]
    chat = parse_chat_request(await read_text_body(request, state))

    async def answer(generations: list[Generation]) -> web.StreamResponse:
        if chat.stream:
            return await _stream(request, state, chat, generations)
        return await _complete(state, chat, generations)

    return await generate_chat(state, chat, started, stages, "chatcmpl-", answer)


async def generate_chat(state: ServerState, chat: ChatCompletionRequest, started: float, stages: PreprocessStages,
                        id_prefix: str,
                        answer: Callable[[list[Generation]], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The one generation path of a chat request (``/v1/chat/completions`` and
    ``/v1/responses``): the model and the cheap bounds checked, the grammar compiled, the
    messages preprocessed on the pool, one ``Generation`` per choice; ``answer`` renders
    them, within the media lease (decoded media are held until the answer is done)."""
    if chat.model != state.config.model_name:
        raise model_not_found(chat.model)
    chat.sampling.check_vocabulary(state.preprocessor.vocab_size)
    state.preprocessor.check_text_length(chat.messages)  # 400 before a thread is taken
    grammar = await compile_structured_output(state, chat.structured) if chat.structured else None
    with state.admission.media_lease() as lease:
        processed = await state.admission.preprocess(
            lambda deadline: state.preprocessor.process_chat(
                chat.messages, chat.mm_processor_kwargs, chat.chat_template_kwargs, deadline=deadline, lease=lease,
                stages=stages,
            ),
            stages, media=state.preprocessor.holds_media(chat.messages),
        )
        engine_requests = choice_requests(state, f"{id_prefix}{uuid.uuid4().hex}", processed, chat.sampling, grammar)
        generations = [
            Generation(state, engine_request, chat.sampling, started, index, counts_prompt=index == 0,
                       preprocess_stages=stages)
            for index, engine_request in enumerate(engine_requests)
        ]
        return await answer(generations)


async def _complete(state: ServerState, chat: ChatCompletionRequest, generations: list[Generation]) -> web.Response:
    async with aclosing(merged_deltas(generations)) as deltas:  # an engine error propagates: 400 or 500
        async for _ in deltas:
            pass
    first = generations[0]
    choices = [
        responses.completion_choice(
            g.index, g.text, g.finish_reason or "stop", g.token_ids if chat.return_token_ids else None,
            responses.logprobs_content(state.tokenizer, g.logprobs) if chat.logprobs else None,
        )
        for g in generations
    ]
    body = responses.completion(
        response_id(first), int(time.time()), state.config.model_name, choices, usage(generations),
        first.engine_request.prompt_token_ids if chat.return_token_ids else None,
    )
    return web.json_response(body, dumps=_dumps)


async def _stream(request: web.Request, state: ServerState, chat: ChatCompletionRequest, generations: list[Generation]):
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    request_id = response_id(generations[0])
    created = int(time.time())
    model = state.config.model_name

    async def send(body: dict) -> None:
        await response.write(b"data: " + orjson.dumps(body) + b"\n\n")

    first_extra = {"prompt_token_ids": generations[0].engine_request.prompt_token_ids} if chat.return_token_ids else {}
    roles_sent = False

    async def send_roles() -> None:
        """Each choice's role chunk, sent when the first token exists (as vLLM does): a
        client that stamps its time to first token at the first chunk (vLLM's own
        benchmark) then measures the prefill, not the preprocessing alone."""
        nonlocal roles_sent
        roles_sent = True
        for g in generations:
            await send(responses.chunk(request_id, created, model, g.index, {"role": "assistant", "content": ""},
                                       **(first_extra if g.index == 0 else {})))

    try:
        try:
            async with aclosing(merged_deltas(generations)) as deltas:
                async for delta in deltas:
                    if not roles_sent:
                        await send_roles()
                    if not delta.text and not delta.finish_reason and not chat.return_token_ids and not chat.logprobs:
                        continue
                    await send(
                        responses.chunk(
                            request_id, created, model, delta.index, {"content": delta.text} if delta.text else {},
                            delta.finish_reason,
                            token_ids=list(delta.token_ids) if chat.return_token_ids else None,
                            logprobs=responses.logprobs_content(state.tokenizer, delta.logprobs or [])
                            if chat.logprobs else None,
                        )
                    )
        except VlmdError as exc:  # the status line is sent: the error goes in the stream
            await send(exc.to_dict())
        else:
            if not roles_sent:
                await send_roles()
            if chat.include_usage:
                await send(responses.usage_chunk(request_id, created, model, usage(generations)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left mid-stream: a normal abort, not a server error
        log.info("client disconnected during the stream", request_id=request_id)
    return response


def response_id(generation: Generation) -> str:
    """The response's id: the choices' engine ids without their ``-<index>``."""
    return generation.engine_request.request_id.rsplit("-", 1)[0]


def _dumps(body) -> str:
    return orjson.dumps(body).decode()


__all__ = ["chat_completions", "generate_chat", "read_json", "read_text_body", "response_id", "VlmdError"]
