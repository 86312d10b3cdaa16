"""Validating an OpenAI Responses body (``POST /v1/responses``) into the chat request that
``/v1/chat/completions`` serves, so both routes run one generation path.

``input`` (a string, or message items) and ``instructions`` become chat ``messages``;
``max_output_tokens``, ``temperature`` and ``top_p`` the sampling fields; ``text.format``
the structured-output constraint. Every other field is read here, accepted at the value
that asks for nothing, or refused by name (``request_fields.RequestFields``), as on the
other routes. Nothing is stored: ``store`` is accepted and answered ``false`` (D77), and
``previous_response_id`` is a 400.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmd.errors import BadRequestError
from vlmd.server.protocol import ChatCompletionRequest
from vlmd.server.request_fields import RequestFields, describe_value
from vlmd.server.responses_input import input_messages
from vlmd.server.sampling_fields import SamplingFields
from vlmd.structured.spec import ANY_JSON_OBJECT, StructuredOutputSpec, constraint
from vlmd.types import SamplingParams

NO_LIMIT = 2**31  # max_tokens when none is given: the context's room decides (SamplingFields.for_choice)
_JSON_SCHEMA_KEYS = {"type", "name", "schema", "strict", "description"}


@dataclass
class ResponsesRequest:
    chat: ChatCompletionRequest  # what the chat path generates from
    # Echoed in the response object, as OpenAI's API does.
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    parallel_tool_calls: bool = True
    tool_choice: str = "auto"


def parse_responses_request(body: Any) -> ResponsesRequest:
    fields = RequestFields(body)
    model = fields.get("model", str)
    instructions = fields.get("instructions", str, None)
    messages = input_messages(fields.get("input", (str, list)), instructions)
    max_output_tokens = fields.get("max_output_tokens", int, None)
    if max_output_tokens is not None and max_output_tokens < 1:
        raise BadRequestError("'max_output_tokens' must be at least 1", param="max_output_tokens")
    temperature = fields.number("temperature", 1.0)
    top_p = fields.number("top_p", 1.0)
    params = SamplingParams(max_tokens=max_output_tokens or NO_LIMIT, temperature=temperature, top_p=top_p)
    text_format, structured = _text_format(fields.get("text", dict, {}))
    _read_no_op_fields(fields)
    request = ResponsesRequest(
        chat=ChatCompletionRequest(
            model=model, messages=messages, sampling=SamplingFields(max_tokens=max_output_tokens, params=params),
            stream=fields.get("stream", bool, False), structured=structured,
        ),
        instructions=instructions, max_output_tokens=max_output_tokens, temperature=temperature, top_p=top_p,
        text_format=text_format, metadata=_metadata(fields.get("metadata", dict, {})),
        user=fields.get("user", str, None), parallel_tool_calls=fields.get("parallel_tool_calls", bool, True),
        tool_choice=fields.get("tool_choice", str, "auto"),
    )
    fields.finish()
    return request


def _read_no_op_fields(fields: RequestFields) -> None:
    """Fields accepted only at the values that ask for nothing; any other value would
    change the answer in a way vlmd does not implement, so it is a 400 that says why."""
    # Nothing is kept after the answer, so store=true (OpenAI's default) keeps nothing and
    # the response says "store": false; a client that needs the response again has it.
    fields.get("store", bool, True)
    no_tools = "no tool calling: vlmd has no tool-call parser, so a call would come back as plain text"
    _no_op_only(fields, "tools", lambda v: v == [], no_tools)
    if fields.body.get("tool_choice") not in (None, "none", "auto"):  # "auto" with no tools calls none
        raise BadRequestError(f"'tool_choice' is not supported: {no_tools}", param="tool_choice")
    _no_op_only(fields, "max_tool_calls", lambda v: isinstance(v, int) and not isinstance(v, bool), no_tools)
    _no_op_only(fields, "previous_response_id", lambda v: False,
                "vlmd stores no responses (store is answered false); send the earlier turns in 'input'")
    _no_op_only(fields, "conversation", lambda v: False, "vlmd stores no conversations; send the turns in 'input'")
    _no_op_only(fields, "prompt", lambda v: False, "vlmd stores no prompt templates; send the text in 'input'")
    _no_op_only(fields, "background", lambda v: v is False, "every response is generated while the request waits")
    _no_op_only(fields, "reasoning", _no_reasoning, "the served models have no reasoning mode")
    _no_op_only(fields, "truncation", lambda v: v == "disabled",
                "the input is never cut to fit; a prompt past the context is a 400")
    _no_op_only(fields, "include", lambda v: v == [], "no extra output (logprobs, tool results) is implemented")
    _no_op_only(fields, "top_logprobs", lambda v: v == 0, "log-probabilities are not implemented on /v1/responses")
    _no_op_only(fields, "stream_options", _no_stream_options, "the only stream option is include_obfuscation")
    _no_op_only(fields, "prompt_cache_retention", lambda v: v == "in_memory",
                "the prefix cache lives in memory, for as long as its blocks are not needed")


def _no_op_only(fields: RequestFields, name: str, allowed: Callable[[Any], bool], reason: str) -> None:
    fields.raw(name)  # read: finish() does not refuse it again
    value = fields.body.get(name)
    if value is not None and not allowed(value):
        raise BadRequestError(f"'{name}' is not supported with {describe_value(value)}: {reason}", param=name)


def _no_reasoning(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) <= {"effort", "summary", "generate_summary"}
            and value.get("effort") in (None, "none") and value.get("summary") is None
            and value.get("generate_summary") is None)


def _no_stream_options(value: Any) -> bool:
    """Obfuscation pads delta events against length side channels; it changes no text."""
    return isinstance(value, dict) and set(value) <= {"include_obfuscation"} and all(
        isinstance(v, bool) for v in value.values())


def _text_format(text: dict) -> tuple[dict[str, Any], StructuredOutputSpec | None]:
    """``text.format``: the format echoed in the response, and its output constraint."""
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise BadRequestError(f"'text' has the unknown field {describe_value(unknown[0])}", param="text")
    if text.get("verbosity") not in (None, "medium"):  # medium is OpenAI's default
        raise BadRequestError("'text.verbosity' is not supported: the served models have no verbosity control",
                              param="text")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}, None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise BadRequestError("'text.format' must be an object with a 'type'", param="text")
    kind = fmt["type"]
    if kind in ("text", "json_object"):
        if set(fmt) != {"type"}:
            raise BadRequestError(f"'text.format' of type '{kind}' takes no other field", param="text")
        return fmt, None if kind == "text" else StructuredOutputSpec("json", ANY_JSON_OBJECT, "text")
    if kind != "json_schema":
        raise BadRequestError(f"'text.format.type' {describe_value(kind)} is not supported (use 'text', "
                              "'json_object' or 'json_schema')", param="text")
    unknown = sorted(set(fmt) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise BadRequestError(f"'text.format' has the unknown field {describe_value(unknown[0])}", param="text")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise BadRequestError("'text.format.name' must be a non-empty string", param="text")
    if not isinstance(fmt.get("strict", False), (bool, type(None))):
        raise BadRequestError("'text.format.strict' must be a boolean", param="text")
    if "schema" not in fmt:
        raise BadRequestError("'text.format' of type 'json_schema' needs a 'schema'", param="text")
    return fmt, constraint("json", fmt["schema"], "text")


def _metadata(metadata: dict) -> dict[str, str]:
    """Tags echoed back, as OpenAI bounds them (16 pairs, 64-character keys, 512-character values)."""
    if len(metadata) > 16:
        raise BadRequestError("'metadata' holds at most 16 pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise BadRequestError("'metadata' maps keys of at most 64 characters to strings of at most 512",
                                  param="metadata")
    return metadata
