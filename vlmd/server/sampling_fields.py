"""The sampling fields that chat and text completions share, read from a request body.

OpenAI's (``n``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``max_tokens``) and vLLM's extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``skip_special_tokens``). Range checks live in ``SamplingParams`` so every entry point
shares them; what needs the model (the vocabulary, the context length) is checked later.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vlmd.errors import BadRequestError
from vlmd.server.request_fields import RequestFields
from vlmd.types import SamplingParams

MAX_N = 16  # choices per prompt: each is an engine request of its own
MAX_LOGIT_BIAS = 1024  # entries


@dataclass
class SamplingFields:
    n: int = 1
    max_tokens: int | None = None  # None: whatever room the context leaves
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    params: SamplingParams = field(default_factory=SamplingParams)

    def for_choice(self, choice: int, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """The choice's parameters: its max_tokens checked against the context, its own
        seed stream (``seed + choice``), so choices differ and each is reproducible."""
        room = max_model_len - num_prompt_tokens
        if self.max_tokens is not None and self.max_tokens > room:
            raise BadRequestError(
                f"this model's maximum context length is {max_model_len} tokens; the request has "
                f"{num_prompt_tokens} prompt tokens and asks for {self.max_tokens} completion tokens",
                param="max_tokens",
            )
        seed = self.params.seed
        return replace(
            self.params,
            max_tokens=self.max_tokens if self.max_tokens is not None else room,
            seed=None if seed is None else seed + choice,
        )

    def check_vocabulary(self, vocab_size: int) -> None:
        """Token ids beyond the logits would fail the sampler (and the whole batch)."""
        for name, ids in (("stop_token_ids", self.params.stop_token_ids),
                          ("logit_bias", [token for token, _ in self.params.logit_bias])):
            out_of_range = [t for t in ids if t >= vocab_size]
            if out_of_range:
                raise BadRequestError(
                    f"{name} must be below the vocabulary size {vocab_size}, got {out_of_range[0]}", param=name
                )


def read_sampling_fields(
    fields: RequestFields, *, logprobs: int | None, default_max_tokens: int | None
) -> SamplingFields:
    max_tokens = fields.get("max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = fields.get("max_tokens", int, default_max_tokens)
    else:
        fields.get("max_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequestError("'max_tokens' must be at least 1", param="max_tokens")
    n = fields.get("n", int, 1)
    if not 1 <= n <= MAX_N:
        raise BadRequestError(f"'n' must be between 1 and {MAX_N}", param="n")
    stop = fields.get("stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequestError("'stop' must be a string or a list of non-empty strings", param="stop")
    stop_token_ids = fields.get("stop_token_ids", list, [])
    if not all(_is_token_id(t) for t in stop_token_ids):
        raise BadRequestError("'stop_token_ids' must be a list of non-negative integers", param="stop_token_ids")
    top_k = fields.get("top_k", int, 0)
    params = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else 2**31,  # checked against the context later
        temperature=fields.number("temperature", 1.0),
        top_p=fields.number("top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,
        min_p=fields.number("min_p", 0.0),
        presence_penalty=fields.number("presence_penalty", 0.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0),
        repetition_penalty=fields.number("repetition_penalty", 1.0),
        logit_bias=_logit_bias(fields),
        min_tokens=fields.get("min_tokens", int, 0),
        seed=fields.get("seed", int, None),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=fields.get("ignore_eos", bool, False),
        logprobs=logprobs,
    )
    return SamplingFields(
        n=n, max_tokens=max_tokens, stop=stop,
        skip_special_tokens=fields.get("skip_special_tokens", bool, True), params=params,
    )


def _logit_bias(fields: RequestFields) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a JSON string key) to a bias in [-100, 100]."""
    bias = fields.get("logit_bias", dict, {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequestError(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    entries: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else None
        if token is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise BadRequestError(
                "'logit_bias' maps token ids (as strings) to numbers between -100 and 100", param="logit_bias"
            )
        entries[token] = float(value)
    return tuple(sorted(entries.items()))


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
