"""Strict request bodies: every field is read by a parser, refused by name, or on a short
list of fields that have no effect by OpenAI's own definition.

A parser reads fields through ``RequestFields.get``, which records each name; ``finish``
then answers 400 for every field left over, naming it (and why, where we know), the way
OpenAI answers "Unrecognized request argument supplied". A field that is silently
ignored gives a user wrong output without a word, so there is no "accept and drop".

An error names a client's value by its type and size (``describe_value``), never by its
content: a value may be megabytes, and its text would be built, sent and logged whole
(issue 50: a 60 MB ``tools`` list took 4.9 s to refuse and 61 MiB of log).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlmd.errors import BadRequestError, NotFoundError

_MISSING = object()
_SHOWN_CHARACTERS = 64  # a client's name or short text shown as it is, up to this length


def describe_value(value: Any) -> str:
    """A client's value as an error message may name it: a short string, a number or a
    boolean as it is; anything else by its type and size."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):  # JSON numbers: bounded in size
        return f"the number {value}"
    if isinstance(value, str):
        if len(value) <= _SHOWN_CHARACTERS and value.isprintable():
            return f"'{value}'"
        return f"a string of {len(value)} characters"
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"an object with {len(value)} keys"
    return f"a value of type {type(value).__name__}"


def model_not_found(model: Any) -> NotFoundError:
    """The 404 for a model this server does not serve, named as OpenAI's API names it when
    the name is short enough to show."""
    shown = f"`{model}`" if isinstance(model, str) and field_param(model) is not None else describe_value(model)
    return NotFoundError(f"The model {shown} does not exist.", param="model", code="model_not_found")


def field_param(name: str) -> str | None:
    """A client's field name as the error's ``param``: itself when it is short enough to show."""
    return name if len(name) <= _SHOWN_CHARACTERS and name.isprintable() else None

# Fields accepted with no effect, because OpenAI defines them as having none on the
# output: identifiers and tags for OpenAI's own dashboards, abuse monitoring and routing.
# The check says which values keep that true (``store: true`` would ask us to keep the
# completion, which we never do, so it is refused).
NO_EFFECT_FIELDS: dict[str, Callable[[Any], bool]] = {
    "user": lambda value: value is None or isinstance(value, str),
    "safety_identifier": lambda value: value is None or isinstance(value, str),
    "metadata": lambda value: value is None or isinstance(value, dict),
    "prompt_cache_key": lambda value: value is None or isinstance(value, str),
    "store": lambda value: value in (None, False),
    "service_tier": lambda value: value in (None, "auto", "default"),
    # vLLM's and SGLang's extensions at the values that leave the answer as vlmd gives it:
    # routers add them to every body they forward (vllm-router 0.1.17 sends
    # no_stop_trim, separate_reasoning, stream_reasoning, include_reasoning,
    # return_hidden_states and continue_final_message, besides fields vlmd reads), so a
    # router in front of vlmd works. A value that would change the answer stays a 400.
    "no_stop_trim": lambda value: value in (None, False),  # stop strings are always cut
    "continue_final_message": lambda value: value in (None, False),  # a new assistant turn
    "return_hidden_states": lambda value: value in (None, False),
    # Reasoning output: the served families have no reasoning mode, so any boolean is the
    # same answer. (A family with one must read these fields instead.)
    "separate_reasoning": lambda value: value is None or isinstance(value, bool),
    "stream_reasoning": lambda value: value is None or isinstance(value, bool),
    "include_reasoning": lambda value: value is None or isinstance(value, bool),
}

# Fields we know and refuse, with the reason a user needs.
_TOOLS_REASON = (
    "no tool calling: vlmd has no tool-call parser, so a model's call would come back as plain "
    "text in the message content, never as tool_calls"
)
NOT_SUPPORTED_FIELDS: dict[str, str] = {
    "tools": _TOOLS_REASON,
    "tool_choice": _TOOLS_REASON,
    "functions": _TOOLS_REASON,
    "function_call": _TOOLS_REASON,
    "parallel_tool_calls": _TOOLS_REASON,
    "audio": "the served models answer in text only",
    "modalities": "only text output (modalities ['text'])",
    "prediction": "no predicted outputs",
    "reasoning_effort": "the served models have no reasoning mode",
    "verbosity": "the served models have no verbosity control",
    "web_search_options": "no web search",
    "suffix": "no insertion (suffix)",
    "best_of": "best_of is a text-completions field (/v1/completions)",
    "echo": "echo is a text-completions field (/v1/completions)",
    "include_stop_str_in_output": "stop strings are always cut from the output",
    "no_stop_trim": "stop strings are always cut from the output",
    "continue_final_message": "a request always starts a new assistant turn (add_generation_prompt)",
    "return_hidden_states": "responses carry tokens and text, not hidden states",
    "chat_template": "the checkpoint's own chat template is always used",
    "chunking_strategy": "audio is always cut into windows of at most 30 s at quiet points",
    "known_speaker_names": "no speaker diarization",
    "known_speaker_references": "no speaker diarization",
}


class RequestFields:
    """A JSON body being read field by field."""

    def __init__(self, body: Any, what: str = "the request body"):
        if not isinstance(body, dict):
            raise BadRequestError(f"{what} must be a JSON object")
        self.body = body
        self._read: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return self.body.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        """The value as sent (None counts as absent), unchecked."""
        self._read.add(name)
        value = self.body.get(name)
        return default if value is None else value

    def get(self, name: str, kinds, default: Any = _MISSING) -> Any:
        """The value if it has one of ``kinds`` (bool is never an int here); ``default``
        when absent or null; 400 when required and absent, or of the wrong type."""
        self._read.add(name)
        value = self.body.get(name)
        if value is None:
            if default is _MISSING:
                raise BadRequestError(f"'{name}' is required", param=name)
            return default
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise BadRequestError(f"'{name}' has the wrong type", param=name)
        return value

    def number(self, name: str, default: float) -> float:
        value = float(self.get(name, (int, float), default))
        if value != value or value in (float("inf"), float("-inf")):
            raise BadRequestError(f"'{name}' must be a finite number", param=name)
        return value

    def accept_when(self, name: str, allowed: Callable[[Any], bool]) -> None:
        """Read a field whose only accepted values are the ones with no effect."""
        self._read.add(name)
        if name in self.body and not allowed(self.body[name]):
            raise BadRequestError(_reason(name, f"'{name}' with this value is not supported"), param=name)

    def finish(self) -> None:
        """400 for the first field no parser read (in the body's order), naming it."""
        for name, value in self.body.items():
            if name in self._read or value is None:  # null asks for nothing
                continue
            check = NO_EFFECT_FIELDS.get(name)
            if check is not None:
                if check(value):
                    continue
                raise BadRequestError(_reason(name, f"'{name}' is not supported with {describe_value(value)}"),
                                      param=name)
            raise BadRequestError(unsupported_field_message(name), param=field_param(name))


def unsupported_field_message(name: str) -> str:
    return _reason(name, f"unrecognized request field {describe_value(name)}")


def _reason(name: str, fallback: str) -> str:
    reason = NOT_SUPPORTED_FIELDS.get(name)
    return f"'{name}' is not supported: {reason}" if reason else fallback
