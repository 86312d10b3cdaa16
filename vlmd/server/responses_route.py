"""POST /v1/responses: OpenAI's Responses API over the chat generation path.

The body becomes the chat request ``/v1/chat/completions`` serves (``responses_protocol``);
``chat.generate_chat`` checks, preprocesses and generates it; this module only renders the
one choice as a ``response`` object or as the Responses event stream. Errors keep chat's
vocabulary, with the field named as this API names it (``input``, not ``messages``).
"""

from __future__ import annotations

import time
from contextlib import aclosing

import orjson
import structlog
from aiohttp import web

from vlmd.errors import VlmdError
from vlmd.processing.stages import PreprocessStages
from vlmd.server.chat import generate_chat, read_text_body, response_id
from vlmd.server.generation import Generation, merged_deltas, usage
from vlmd.server.response_objects import EventStream, output_message, response_object, response_usage
from vlmd.server.responses_protocol import ResponsesRequest, parse_responses_request
from vlmd.server.state import ServerState

log = structlog.get_logger(__name__)

# Chat's field names, as this API calls the same fields.
_FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


async def create_response(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    stages = PreprocessStages()  # from its arrival (D109, D116)
    state: ServerState = request.app["state"]
    parsed = parse_responses_request(await read_text_body(request, state))  # its errors name its fields

    async def answer(generations: list[Generation]) -> web.StreamResponse:
        if parsed.chat.stream:
            return await _stream(request, state, parsed, generations[0])
        return await _complete(state, parsed, generations[0])

    try:
        return await generate_chat(state, parsed.chat, started, stages, "resp_", answer)
    except VlmdError as exc:  # the chat path names chat's fields
        _named_for_responses(exc)
        raise


def _named_for_responses(exc: VlmdError) -> VlmdError:
    exc.param = _FIELD_NAMES.get(exc.param, exc.param)
    return exc


def _finished(state: ServerState, parsed: ResponsesRequest, generation: Generation, created_at: int) -> dict:
    """The response object once its one choice has finished."""
    status = "incomplete" if generation.finish_reason == "length" else "completed"
    resp_id = response_id(generation)
    message = output_message(_item_id(resp_id), status, generation.text)
    return response_object(resp_id, created_at, parsed, state.config.model_name, status, [message],
                           response_usage(usage([generation])), completed_at=int(time.time()))


async def _complete(state: ServerState, parsed: ResponsesRequest, generation: Generation) -> web.Response:
    created_at = int(time.time())
    async with aclosing(merged_deltas([generation])) as deltas:  # an engine error propagates: 400 or 500
        async for _ in deltas:
            pass
    body = _finished(state, parsed, generation, created_at)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _stream(request: web.Request, state: ServerState, parsed: ResponsesRequest,
                  generation: Generation) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    created_at = int(time.time())
    resp_id = response_id(generation)
    item_id = _item_id(resp_id)
    events = EventStream()
    opened = False

    async def send(frames: list[bytes]) -> None:
        for frame in frames:
            await response.write(frame)

    async def open_response() -> None:
        """The opening events, sent with the first token (D76: nothing before it)."""
        nonlocal opened
        opened = True
        started = response_object(resp_id, created_at, parsed, state.config.model_name, "in_progress", [])
        await send(events.opening(started, item_id))

    try:
        try:
            async with aclosing(merged_deltas([generation])) as deltas:  # leaving it aborts the engine request
                async for delta in deltas:
                    if not opened:
                        await open_response()
                    if delta.text:
                        await send([events.text_delta(item_id, delta.text)])
        except VlmdError as exc:  # the status line is sent: the error goes in the stream
            await send([events.error(_named_for_responses(exc).to_dict()["error"])])
        else:
            if not opened:
                await open_response()
            finished = _finished(state, parsed, generation, created_at)
            await send(events.closing(finished, item_id, generation.text))
        await response.write_eof()
    except ConnectionResetError:  # the client left mid-stream: a normal abort, not a server error
        log.info("client disconnected during the stream", request_id=resp_id)
    return response


def _item_id(resp_id: str) -> str:
    """The message item's id: the response's own hex under OpenAI's ``msg_`` prefix."""
    return "msg_" + resp_id.removeprefix("resp_")
