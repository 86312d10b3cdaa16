"""Validating an OpenAI chat-completions body into a plain request object.

Every field is read here (or by ``sampling_fields``), refused by name, or one of the few
that have no effect by OpenAI's definition (``request_fields.NO_EFFECT_FIELDS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmd.errors import BadRequestError
from vlmd.server.request_fields import RequestFields, describe_value
from vlmd.structured.spec import StructuredOutputSpec
from vlmd.structured.spec import parse_structured_output as parse_spec
from vlmd.server.sampling_fields import SamplingFields, read_sampling_fields

MAX_TOP_LOGPROBS = 20


@dataclass
class ChatCompletionRequest:
    model: str
    messages: list
    sampling: SamplingFields
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    structured: StructuredOutputSpec | None = None  # response_format / structured_outputs / guided_*


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    fields = RequestFields(body)
    model = fields.get("model", str)
    messages = fields.get("messages", list)
    logprobs = fields.get("logprobs", bool, False)
    top_logprobs = fields.get("top_logprobs", int, 0)
    if top_logprobs and not logprobs:
        raise BadRequestError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    sampling = read_sampling_fields(fields, logprobs=top_logprobs if logprobs else None, default_max_tokens=None)
    # No tools and no forced tool call ask for nothing; anything else is refused by name.
    fields.accept_when("tools", lambda value: value in (None, []))
    fields.accept_when("tool_choice", lambda value: value in (None, "none"))
    fields.accept_when("modalities", lambda value: value in (None, ["text"]))
    request = ChatCompletionRequest(
        model=model,
        messages=messages,
        sampling=sampling,
        logprobs=logprobs,
        stream=fields.get("stream", bool, False),
        include_usage=read_stream_options(fields),
        return_token_ids=fields.get("return_token_ids", bool, False),
        mm_processor_kwargs=fields.get("mm_processor_kwargs", dict, None),
        chat_template_kwargs=fields.get("chat_template_kwargs", dict, None),
        structured=parse_structured_output(fields),
    )
    fields.finish()
    return request


def read_stream_options(fields: RequestFields) -> bool:
    """``stream_options``: ``include_usage`` is the only option (a final usage chunk)."""
    options = fields.get("stream_options", dict, {})
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise BadRequestError(f"stream_options has the unsupported field {describe_value(unknown[0])}",
                              param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequestError("stream_options.include_usage must be true or false", param="stream_options")
    return include_usage


# ---- structured outputs ------------------------------------------------------------------
# The ONE place the structured-output fields of chat and text completions are read;
# vlmd/structured/spec.py turns them into a StructuredOutputSpec (400s name the field).

STRUCTURED_OUTPUT_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
)


def parse_structured_output(fields: RequestFields) -> StructuredOutputSpec | None:
    """What constrains the output's shape, or None for free text."""
    return parse_spec({name: fields.raw(name) for name in STRUCTURED_OUTPUT_FIELDS})
