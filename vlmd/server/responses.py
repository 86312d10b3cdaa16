"""OpenAI-shaped response bodies: chat and text completions, chunks, usage, logprobs."""

from __future__ import annotations

from typing import Any

from vlmd.server.modality_tokens import openai_token_details
from vlmd.types import TokenLogprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          multimodal_tokens: dict[str, int] | None = None) -> dict:
    """``multimodal_tokens``: the prompt's placeholder tokens per modality (vLLM's field,
    ``server/modality_tokens.py``), left out for a prompt without media; the same counts in
    OpenAI's typed fields (``text_tokens``, ``image_tokens``, ``audio_tokens``) always."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens,
                               **openai_token_details(prompt_tokens, multimodal_tokens or {})}
    if multimodal_tokens:
        details["multimodal_tokens"] = multimodal_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }


def logprobs_content(tokenizer, entries: list[TokenLogprob]) -> list[dict]:
    def one(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [
        {**one(entry.token_id, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}
        for entry in entries
    ]


def completion_choice(
    index: int, text: str, finish_reason: str, token_ids: list[int] | None, logprobs: list[dict] | None
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": {"content": logprobs} if logprobs is not None else None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def completion(
    request_id: str, created: int, model: str, choices: list[dict], usage_body: dict,
    prompt_token_ids: list[int] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body,
    }
    if prompt_token_ids is not None:
        body["prompt_token_ids"] = prompt_token_ids
    return body


def chunk(
    request_id: str, created: int, model: str, index: int, delta: dict, finish_reason: str | None = None,
    token_ids: list[int] | None = None, logprobs: list[dict] | None = None, **extra: Any,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
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


def usage_chunk(request_id: str, created: int, model: str, usage_body: dict,
                object_name: str = "chat.completion.chunk") -> dict[str, Any]:
    return {
        "id": request_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body,
    }


# ---- /v1/completions (OpenAI's legacy text completions) ----------------------------------


def text_logprobs(tokenizer, entries: list[TokenLogprob], text_offset: int = 0) -> dict:
    """The legacy shape: parallel lists of token strings, log-probs, top alternatives and
    each token's character offset in the choice's text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        piece = tokenizer.decode([entry.token_id])
        tokens.append(piece)
        token_logprobs.append(entry.logprob)
        top.append({tokenizer.decode([t]): lp for t, lp in entry.top} if entry.top else None)
        offsets.append(text_offset)
        text_offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def text_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None,
                token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def text_completion(request_id: str, created: int, model: str, choices: list[dict], usage_body: dict | None,
                    streaming: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": choices}
    if not streaming:
        body["usage"] = usage_body
    return body
