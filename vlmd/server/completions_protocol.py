"""Validating an OpenAI text-completions body (``POST /v1/completions``).

``prompt`` is a string, a list of token ids, or a batch of either (each prompt gets ``n``
choices, indexed ``prompt * n + choice`` as OpenAI does). ``logprobs`` is the legacy
integer (top alternatives per token); ``echo`` puts the prompt's text before each choice's
text, but not with ``logprobs``, which would need the prompt's log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmd.errors import BadRequestError
from vlmd.server.protocol import MAX_TOP_LOGPROBS, parse_structured_output, read_stream_options
from vlmd.server.request_fields import RequestFields
from vlmd.structured.spec import StructuredOutputSpec
from vlmd.server.sampling_fields import SamplingFields, read_sampling_fields

MAX_CHOICES = 64  # prompts x n in one request
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for text completions


@dataclass
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]
    sampling: SamplingFields
    logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    add_special_tokens: bool = True
    return_token_ids: bool = False
    structured: StructuredOutputSpec | None = None  # response_format / structured_outputs / guided_*


def parse_completion_request(body: Any) -> CompletionRequest:
    fields = RequestFields(body)
    model = fields.get("model", str)
    prompts = _prompts(fields.get("prompt", (str, list)))
    logprobs = fields.get("logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequestError(f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
    sampling = read_sampling_fields(fields, logprobs=logprobs, default_max_tokens=DEFAULT_MAX_TOKENS)
    best_of = fields.get("best_of", int, None)
    if best_of is not None and best_of != sampling.n:
        raise BadRequestError("'best_of' must equal n (ranking choices is not supported)", param="best_of")
    echo = fields.get("echo", bool, False)
    if echo and logprobs is not None:
        raise BadRequestError("'echo' with 'logprobs' is not supported (no prompt log-probabilities)", param="echo")
    if len(prompts) * sampling.n > MAX_CHOICES:
        raise BadRequestError(f"at most {MAX_CHOICES} choices per request (prompts x n)", param="prompt")
    request = CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=sampling,
        logprobs=logprobs,
        echo=echo,
        stream=fields.get("stream", bool, False),
        include_usage=read_stream_options(fields),
        add_special_tokens=fields.get("add_special_tokens", bool, True),
        return_token_ids=fields.get("return_token_ids", bool, False),
        structured=parse_structured_output(fields),
    )
    fields.finish()
    return request


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError("'prompt' must not be empty", param="prompt")
    if all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise BadRequestError(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists", param="prompt"
    )


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
