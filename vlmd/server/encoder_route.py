"""POST /v1/encoder_outputs: an encoder server's one route (``vlmd serve --encoder-only``).

Body (JSON): ``{"model": NAME, "items": [content part, ...], "mm_processor_kwargs": {...}}``,
the items being chat content parts (``image_url``, ``video_url``, ``audio_url``,
``input_audio``). They are fetched, decoded and processed under every bound a chat request
meets (admission, the media policy and limits, the preprocess deadline and media lease),
encoded on the engine thread between its steps, and answered as one safetensors body: each
distinct item's encoder output named by its identifier (``vlmd/encoder_wire.py``,
docs/encoder-wire-format.md). Mistakes are OpenAI-shaped 4xx, as on every route.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from vlmd.encoder_wire import MEDIA_TYPE, pack
from vlmd.errors import BadRequestError
from vlmd.server.chat import read_text_body
from vlmd.server.request_fields import describe_value, field_param, model_not_found
from vlmd.server.state import ServerState

_FIELDS = {"model", "items", "mm_processor_kwargs"}


async def encoder_outputs(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = await read_text_body(request, state)
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise BadRequestError(f"unrecognized request field {describe_value(unknown[0])}", param=field_param(unknown[0]))
    if body.get("model") != state.config.model_name:
        raise model_not_found(body.get("model"))
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequestError("mm_processor_kwargs must be an object", param="mm_processor_kwargs")
    parts = body.get("items")
    with state.admission.media_lease() as lease:
        items = await state.admission.preprocess(
            lambda deadline: state.preprocessor.process_items(parts, kwargs, deadline=deadline, lease=lease)
        )
        distinct = list({item.identifier: item for item in items}.values())
        outputs = await state.engine.encode(distinct)
    data = await asyncio.get_running_loop().run_in_executor(state.pool, pack, outputs, state.config.model_name)
    return web.Response(body=data, content_type=MEDIA_TYPE)
