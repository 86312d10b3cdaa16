"""OpenAI-shaped response bodies: chat completions, chunks, usage, logprobs."""

from __future__ import annotations

from typing import Any

from vlmd.types import TokenLogprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def logprobs_content(tokenizer, entries: list[TokenLogprob]) -> list[dict]:
    def one(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [
        {**one(entry.token_id, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}
        for entry in entries
    ]


def completion(
    request_id: str, created: int, model: str, text: str, finish_reason: str, usage_body: dict,
    token_ids: list[int] | None, prompt_token_ids: list[int] | None, logprobs: list[dict] | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": {"content": logprobs} if logprobs is not None else None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_body,
    }
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = prompt_token_ids
    return body


def chunk(
    request_id: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
    token_ids: list[int] | None = None, logprobs: list[dict] | None = None, **extra: Any,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": {"content": logprobs} if logprobs is not None else None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
        **extra,
    }


def usage_chunk(request_id: str, created: int, model: str, usage_body: dict) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body,
    }
