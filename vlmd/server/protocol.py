"""Validating an OpenAI chat-completions body into a plain request object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmd.errors import BadRequestError
from vlmd.structured.spec import StructuredOutputSpec, parse_structured_output
from vlmd.types import SamplingParams

_MISSING = object()


def _field(body: dict, name: str, kinds, default=_MISSING, *, allow_none: bool = True):
    value = body.get(name, _MISSING)
    if value is _MISSING or (value is None and allow_none):
        if default is _MISSING:
            raise BadRequestError(f"'{name}' is required", param=name)
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise BadRequestError(f"'{name}' has the wrong type", param=name)
    if not isinstance(value, kinds):
        raise BadRequestError(f"'{name}' has the wrong type", param=name)
    return value


@dataclass
class ChatCompletionRequest:
    model: str
    messages: list
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    mm_processor_kwargs: dict[str, Any] | None = None
    structured: StructuredOutputSpec | None = None  # response_format / structured_outputs / guided_*

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        room = max_model_len - num_prompt_tokens
        if self.max_tokens is not None and self.max_tokens > room:
            raise BadRequestError(
                f"this model's maximum context length is {max_model_len} tokens; the request has "
                f"{num_prompt_tokens} prompt tokens and asks for {self.max_tokens} completion tokens",
                param="max_tokens",
            )
        return self._sampling(self.max_tokens if self.max_tokens is not None else room)

    def _sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.top_logprobs if self.logprobs else None,
        )


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    model = _field(body, "model", str)
    messages = _field(body, "messages", list)
    max_tokens = _field(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", int, None)
    if _field(body, "n", int, 1) != 1:
        raise BadRequestError("only n=1 is supported", param="n")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequestError("'stop' must be a string or a list of non-empty strings", param="stop")
    stop_token_ids = _field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids):
        raise BadRequestError("'stop_token_ids' must be a list of non-negative integers", param="stop_token_ids")
    top_k = _field(body, "top_k", int, 0)
    stream_options = _field(body, "stream_options", dict, {})
    mm_kwargs = _field(body, "mm_processor_kwargs", dict, None)
    request = ChatCompletionRequest(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=float(_field(body, "temperature", (int, float), 1.0)),
        top_p=float(_field(body, "top_p", (int, float), 1.0)),
        top_k=0 if top_k == -1 else top_k,
        min_tokens=_field(body, "min_tokens", int, 0),
        seed=_field(body, "seed", int, None),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=_field(body, "ignore_eos", bool, False),
        logprobs=_field(body, "logprobs", bool, False),
        top_logprobs=_field(body, "top_logprobs", int, 0),
        stream=_field(body, "stream", bool, False),
        include_usage=bool(stream_options.get("include_usage", False)),
        return_token_ids=_field(body, "return_token_ids", bool, False),
        skip_special_tokens=_field(body, "skip_special_tokens", bool, True),
        mm_processor_kwargs=mm_kwargs,
        structured=parse_structured_output(body),
    )
    if request.top_logprobs and not request.logprobs:
        raise BadRequestError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    if request.max_tokens is not None and request.max_tokens < 1:
        raise BadRequestError("'max_tokens' must be at least 1", param="max_tokens")
    # Range checks shared with every other entry point live in SamplingParams. The context
    # length is checked once the prompt is known (sampling_params), with the real numbers.
    request._sampling(request.max_tokens if request.max_tokens is not None else 2**31)
    return request
