"""A Responses ``input`` (and ``instructions``) as the chat ``messages`` the chat path takes.

The content parts map one to one: ``input_text`` and an assistant turn's ``output_text``
are ``text``; ``input_image`` (a URL or a data URL) is ``image_url``; ``input_audio`` is
chat's own ``input_audio``. OpenAI's Responses API has no video part; as vLLM's Responses
server does, chat's ``image_url``, ``video_url`` and ``audio_url`` parts are taken as they
are, so video reaches a Qwen2-VL model here too. What the chat path checks (URLs, media
limits, decoding) it checks for both routes; this module checks the Responses shape and
names its place in ``input``.
"""

from __future__ import annotations

from typing import Any

from vlmd.errors import BadRequestError
from vlmd.server.request_fields import describe_value

_ROLES = {"user", "system", "developer", "assistant"}
# A message item's keys: ``id`` and ``status`` identify an earlier output sent back as
# history (the client's ``response.output``); they change nothing in the prompt.
_MESSAGE_KEYS = {"type", "role", "content", "id", "status"}
_CHAT_MEDIA_PARTS = {"image_url", "video_url", "audio_url"}  # vLLM's extensions, as in chat
# OpenAI's image detail picks its own resolution; the served families' processors fix
# theirs, so only "auto" keeps the answer as OpenAI would define it (chat says the same).
_IMAGE_DETAILS = (None, "auto")


def input_messages(value: str | list, instructions: str | None) -> list[dict]:
    """Chat messages: ``instructions`` first as a system message, then the input's items."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages
    if not value:
        raise BadRequestError("'input' must be a non-empty string or list of items", param="input")
    for index, item in enumerate(value):
        messages.append(_message(item, f"input[{index}]"))
    return messages


def _message(item: Any, where: str) -> dict:
    if not isinstance(item, dict):
        raise BadRequestError(f"{where} must be an object", param="input")
    kind = item.get("type", "message")
    if kind != "message":
        raise BadRequestError(
            f"{where}.type {describe_value(kind)} is not supported: only message items (no tool calls, reasoning or "
            "item references: vlmd stores no items)", param="input")
    for key, value in item.items():
        if key not in _MESSAGE_KEYS and value is not None:
            raise BadRequestError(f"{where} has the unsupported field {describe_value(key)}", param="input")
    role = item.get("role")
    if role not in _ROLES:
        raise BadRequestError(f"{where}.role must be one of {sorted(_ROLES)}", param="input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise BadRequestError(f"{where}.content must be a string or a list of parts", param="input")
    return {"role": role, "content": [_part(part, f"{where}.content[{i}]", role) for i, part in enumerate(content)]}


def _part(part: Any, where: str, role: str) -> dict:
    if not isinstance(part, dict):
        raise BadRequestError(f"{where} must be an object", param="input")
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        if kind == "output_text" and role != "assistant":
            raise BadRequestError(f"{where}: output_text belongs to an assistant message", param="input")
        # An earlier answer's annotations and logprobs describe it; the prompt holds its text.
        allowed = {"type", "text"} | ({"annotations", "logprobs"} if kind == "output_text" else set())
        _check_keys(part, allowed, where)
        return {"type": "text", "text": _text(part, where)}
    if kind == "refusal" and role == "assistant":
        _check_keys(part, {"type", "refusal"}, where)
        refusal = part.get("refusal")
        if not isinstance(refusal, str):
            raise BadRequestError(f"{where}.refusal must be a string", param="input")
        return {"type": "text", "text": refusal}
    if kind == "input_image":
        return _image(part, where)
    if kind == "input_audio":
        _check_keys(part, {"type", "input_audio"}, where)
        return {"type": "input_audio", "input_audio": part.get("input_audio")}
    if kind in _CHAT_MEDIA_PARTS:
        return part
    if kind == "input_file":
        raise BadRequestError(f"{where}: input_file is not supported (no file inputs; images go in input_image)",
                              param="input")
    raise BadRequestError(f"{where}.type {describe_value(kind)} is not supported", param="input")


def _image(part: dict, where: str) -> dict:
    _check_keys(part, {"type", "image_url", "detail", "file_id"}, where)
    if part.get("file_id") is not None:
        raise BadRequestError(f"{where}.file_id is not supported: vlmd has no Files API; send image_url",
                              param="input")
    if part.get("detail") not in _IMAGE_DETAILS:
        raise BadRequestError(
            f"{where}.detail must be 'auto': the model's processor fixes the resolution "
            "(use mm_processor_kwargs on /v1/chat/completions where the family has settings)", param="input")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise BadRequestError(f"{where}.image_url must be a non-empty URL or data URL", param="input")
    return {"type": "image_url", "image_url": {"url": url}}


def _text(part: dict, where: str) -> str:
    text = part.get("text")
    if not isinstance(text, str):
        raise BadRequestError(f"{where}.text must be a string", param="input")
    return text


def _check_keys(part: dict, allowed: set[str], where: str) -> None:
    for key, value in part.items():
        if key not in allowed and value is not None:
            raise BadRequestError(f"{where} has the unsupported field {describe_value(key)}", param="input")
