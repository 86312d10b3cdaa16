"""POST /tokenize and /detokenize, in vLLM's shapes.

``/tokenize`` takes a text ``prompt`` or chat ``messages``. With messages it runs the
whole front end (chat template, media fetch and decode, the family's processor), but not
the engine, so ``count`` includes every placeholder an image or video expands to: what
the item will cost in the context, and ``multimodal_tokens`` says how many of them each
modality takes (as ``usage.prompt_tokens_details`` will). A prompt longer than the context
is still counted.
"""

from __future__ import annotations


import orjson
from aiohttp import web

from vlmd.errors import BadRequestError
from vlmd.server.chat import read_text_body
from vlmd.server.modality_tokens import multimodal_token_counts
from vlmd.server.request_fields import RequestFields, model_not_found
from vlmd.server.state import ServerState


async def tokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    fields = RequestFields(await read_text_body(request, state))
    _check_model(state, fields)
    return_strs = fields.get("return_token_strs", bool, False)
    multimodal_tokens: dict[str, int] = {}
    if "messages" in fields and "prompt" in fields:
        raise BadRequestError("send either 'prompt' or 'messages', not both", param="messages")
    if "messages" in fields:
        messages = fields.get("messages", list)
        add_special_tokens = fields.get("add_special_tokens", bool, False)
        fields.accept_when("add_generation_prompt", lambda value: value in (None, True))
        fields.accept_when("tools", lambda value: value in (None, []))
        mm_kwargs = fields.get("mm_processor_kwargs", dict, None)
        template_kwargs = fields.get("chat_template_kwargs", dict, None)
        fields.finish()
        if add_special_tokens:
            raise BadRequestError("add_special_tokens is not supported with messages (the template adds them)",
                                  param="add_special_tokens")
        process = state.preprocessor.process_chat
        state.preprocessor.check_text_length(messages)  # bounded before the template and tokenizer
        with state.admission.media_lease() as lease:
            processed = await state.admission.preprocess(
                lambda deadline: process(messages, mm_kwargs, template_kwargs, check_length=False,
                                         deadline=deadline, lease=lease),
                media=state.preprocessor.holds_media(messages),
            )
        tokens = processed.prompt_token_ids
        multimodal_tokens = multimodal_token_counts(processed.items)
    else:
        prompt = fields.get("prompt", str)
        add_special_tokens = fields.get("add_special_tokens", bool, True)
        fields.finish()
        limit = state.preprocessor.max_prompt_chars
        if len(prompt) > limit:  # more text than max_model_len tokens hold: not worth tokenizing
            raise BadRequestError(
                f"'prompt' holds {len(prompt)} characters, more than max_model_len "
                f"({state.max_model_len}) tokens can hold: at most {limit} characters", param="prompt")
        tokens = await state.admission.preprocess(
            lambda deadline: state.tokenizer.encode(prompt, add_special_tokens=add_special_tokens), media=False
        )
    body = {
        "count": len(tokens),
        "max_model_len": state.max_model_len,
        "tokens": list(tokens),
        "token_strs": state.tokenizer.convert_ids_to_tokens(list(tokens)) if return_strs else None,
    }
    if multimodal_tokens:  # what each modality will cost, as usage reports it (vLLM's name)
        body["multimodal_tokens"] = multimodal_tokens
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def detokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    fields = RequestFields(await read_text_body(request, state))
    _check_model(state, fields)
    tokens = fields.get("tokens", list)
    fields.finish()
    limit = len(state.tokenizer)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in tokens):
        raise BadRequestError(f"'tokens' must be a list of token ids in [0, {limit})", param="tokens")
    text = state.tokenizer.decode(tokens)
    return web.Response(body=orjson.dumps({"prompt": text}), content_type="application/json")


def _check_model(state: ServerState, fields: RequestFields) -> None:
    """``model`` is optional here, as in vLLM; when given it must be the served one."""
    model = fields.get("model", str, None)
    if model is not None and model != state.config.model_name:
        raise model_not_found(model)
