"""OpenAI chat messages -> the conversation a chat template renders, plus media refs."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlmd.errors import BadRequestError
from vlmd.media.by_uuid import MAX_UUID_CHARS

_ROLES = {"system", "developer", "user", "assistant", "tool"}
# OpenAI content-part type -> (modality, key holding the URL object)
_MEDIA_PARTS = {"image_url": ("image", "image_url"), "video_url": ("video", "video_url"), "audio_url": ("audio", "audio_url")}


# input_audio.format -> the media type of the data URL it becomes (the decoder reads the
# container from the bytes; the name must still be one OpenAI's API allows, or one we read).
INPUT_AUDIO_FORMATS = {
    "wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg",
    "m4a": "audio/mp4", "webm": "audio/webm",
}
# Keys a message may carry, by role. OpenAI's ``name`` (a participant name the model is told
# about) has an effect we do not implement, so it is refused by name, like every other key; a
# null value asks for nothing. An assistant's ``tool_calls`` and a tool result's
# ``tool_call_id`` are history: the chat template renders them (agents send images in tool
# results), and ``check_rendered`` refuses a conversation whose template drops them.
_MESSAGE_KEYS = {"role", "content"}
_ROLE_KEYS = {"assistant": _MESSAGE_KEYS | {"tool_calls"}, "tool": _MESSAGE_KEYS | {"tool_call_id"}}
# ``detail`` picks OpenAI's image resolution; our families have their own, so only "auto".
_URL_KEYS = {"url", "detail"}


def _check_keys(obj: dict, allowed: set[str], where: str) -> None:
    for key, value in obj.items():
        if key not in allowed and value is not None:
            raise BadRequestError(f"{where}.{key} is not supported", param="messages")


@dataclass(frozen=True)
class MediaRef:
    """One media item of a request: its URL (``data:``, ``http(s)://``, ``file://``) and the
    client's ``uuid`` for it (vLLM's), either of which may be absent, not both: a uuid
    without a URL is an item the client sent before (vlmd/media/by_uuid.py)."""

    modality: str
    url: str | None
    uuid: str | None = None
    # An ``image_embeds`` part's value (vlmd/processing/embeds.py): the item's encoder
    # output instead of its media; ``where`` names the part in a 400.
    embeds: Any = None
    where: str = ""


def to_conversation(messages: Any, part_for_modality) -> tuple[list[dict], list[MediaRef]]:
    """Validate ``messages`` and split out media references, in prompt order.

    ``part_for_modality(modality)`` gives the part the family's template expects for
    an item (e.g. ``{"type": "image"}``); it raises BadRequestError for a modality the
    model does not accept.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list", param="messages")
    conversation: list[dict] = []
    media: list[MediaRef] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise BadRequestError(f"{where} must be an object", param="messages")
        role = message.get("role")
        if role not in _ROLES:
            raise BadRequestError(f"{where}.role must be one of {sorted(_ROLES)}", param="messages")
        _check_keys(message, _ROLE_KEYS.get(role, _MESSAGE_KEYS), where)
        role = "system" if role == "developer" else role
        history = _tool_history(message, role, where)
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, str):
            conversation.append({"role": role, "content": content, **history})
            continue
        if not isinstance(content, list):
            raise BadRequestError(f"{where}.content must be a string or a list of parts", param="messages")
        parts = []
        for part_index, part in enumerate(content):
            parts.append(_convert_part(part, f"{where}.content[{part_index}]", part_for_modality, media))
        conversation.append({"role": role, "content": parts, **history})
    return conversation, media


def _tool_history(message: dict, role: str, where: str) -> dict:
    """An assistant's ``tool_calls`` or a tool result's ``tool_call_id``, checked, as the
    template expects them (OpenAI's shape, which Hugging Face templates read)."""
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequestError(f"{where}.tool_call_id must be a non-empty string", param="messages")
        return {"tool_call_id": call_id}
    calls = message.get("tool_calls")
    if role != "assistant" or calls is None:
        return {}
    if not isinstance(calls, list):
        raise BadRequestError(f"{where}.tool_calls must be a list", param="messages")
    checked = []
    for index, call in enumerate(calls):
        at = f"{where}.tool_calls[{index}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise BadRequestError(f"{at} must be an object of type 'function'", param="messages")
        _check_keys(call, {"id", "type", "function"}, at)
        function = call.get("function")
        if not isinstance(function, dict):
            raise BadRequestError(f"{at}.function must be an object with name and arguments", param="messages")
        _check_keys(function, {"name", "arguments"}, f"{at}.function")
        name, arguments = function.get("name"), function.get("arguments", "")
        if not isinstance(name, str) or not name or not isinstance(arguments, str):
            raise BadRequestError(f"{at}.function needs a name and arguments as strings", param="messages")
        checked.append({"id": call.get("id") or f"call_{index}", "type": "function",
                        "function": {"name": name, "arguments": arguments}})
    return {"tool_calls": checked}


def check_rendered(conversation: list[dict], render: Callable[[list[dict]], str]) -> None:
    """400 when the chat template leaves out a tool call or a tool result's text: the model
    would answer without what the client sent, silently. (Media a template leaves out are
    found by the processor, which counts the markers.)

    The template renders a copy of the conversation whose tool-call names and tool-result
    texts are replaced by plain probe words (each ends in x, so none is a prefix of another),
    and each probe must appear, in any case: a template that trims, escapes, JSON-encodes or
    upper-cases what it renders still passes, where a search for the client's own text in the
    prompt would refuse it."""
    probed = copy.deepcopy(conversation)
    wanted: list[tuple[str, str]] = []  # (probe word, the message's complaint)
    for index, message in enumerate(probed):
        for number, call in enumerate(message.get("tool_calls", ())):
            call["function"]["name"] = probe = f"vlmdprobe{index}c{number}x"
            wanted.append((probe, f"messages[{index}].tool_calls: this model's chat template does not render tool calls"))
        if message["role"] != "tool":
            continue
        complaint = f"messages[{index}]: this model's chat template does not render tool messages"
        if isinstance(message["content"], str):
            if message["content"].strip():
                message["content"] = probe = f"vlmdprobe{index}tx"
                wanted.append((probe, complaint))
            continue
        for number, part in enumerate(message["content"]):
            if part.get("type") == "text" and part["text"].strip():
                part["text"] = probe = f"vlmdprobe{index}t{number}x"
                wanted.append((probe, complaint))
    if not wanted:
        return
    rendered = render(probed).lower()  # probes are lower case; a template may change case
    for probe, complaint in wanted:
        if probe not in rendered:
            raise BadRequestError(complaint, param="messages")


def _convert_part(part: Any, where: str, part_for_modality, media: list[MediaRef]) -> dict:
    if not isinstance(part, dict):
        raise BadRequestError(f"{where} must be an object", param="messages")
    kind = part.get("type")
    if kind == "text":
        _check_keys(part, {"type", "text"}, where)
        text = part.get("text")
        if not isinstance(text, str):
            raise BadRequestError(f"{where}.text must be a string", param="messages")
        return {"type": "text", "text": text}
    if kind in _MEDIA_PARTS:
        modality, key = _MEDIA_PARTS[kind]
        _check_keys(part, {"type", key, "uuid"}, where)
        uuid = _item_uuid(part, where)
        value = part.get(key)
        sent_before = value is None or (isinstance(value, dict) and value.get("url") is None)
        if sent_before and uuid is not None:  # the uuid alone names an item sent before
            media.append(MediaRef(modality, None, uuid))
            return part_for_modality(modality)
        if isinstance(value, dict):
            _check_keys(value, _URL_KEYS, f"{where}.{key}")
            if value.get("detail") not in (None, "auto"):
                raise BadRequestError(
                    f"{where}.{key}.detail must be 'auto': the model's processor fixes the resolution "
                    "(use mm_processor_kwargs where the family has settings)", param="messages",
                )
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise BadRequestError(f"{where}.{key}.url must be a non-empty string", param="messages")
        converted = part_for_modality(modality)
        media.append(MediaRef(modality, url, uuid))
        return converted
    if kind == "image_embeds":  # vLLM's: the image's encoder output, computed elsewhere
        _check_keys(part, {"type", "image_embeds", "uuid"}, where)
        uuid = _item_uuid(part, where)
        value = part.get("image_embeds")
        if value is None and uuid is None:
            raise BadRequestError(f"{where}.image_embeds must hold the embeddings (or the part a uuid sent "
                                  "with them before)", param="messages")
        converted = part_for_modality("image")
        media.append(MediaRef("image", None, uuid, embeds=value, where=where))
        return converted
    if kind == "input_audio":
        _check_keys(part, {"type", "input_audio", "uuid"}, where)
        uuid = _item_uuid(part, where)
        value = part.get("input_audio")
        url = None if value is None and uuid is not None else _input_audio_url(value, where)
        converted = part_for_modality("audio")
        media.append(MediaRef("audio", url, uuid))
        return converted
    raise BadRequestError(f"{where}.type {kind!r} is not supported", param="messages")


def _item_uuid(part: dict, where: str) -> str | None:
    """A media part's ``uuid`` (vLLM's: the client's stable name for the item), or None."""
    uuid = part.get("uuid")
    if uuid is None:
        return None
    if not isinstance(uuid, str) or not uuid or len(uuid) > MAX_UUID_CHARS:
        raise BadRequestError(f"{where}.uuid must be a string of 1 to {MAX_UUID_CHARS} characters",
                              param="messages")
    return uuid


def _input_audio_url(value: Any, where: str) -> str:
    """OpenAI's ``{"data": base64, "format": "wav"}`` as a data URL (decoded with the others)."""
    if not isinstance(value, dict):
        raise BadRequestError(f"{where}.input_audio must be an object with data and format", param="messages")
    data, fmt = value.get("data"), value.get("format")
    if not isinstance(data, str) or not data:
        raise BadRequestError(f"{where}.input_audio.data must be a non-empty base64 string", param="messages")
    if fmt not in INPUT_AUDIO_FORMATS:
        raise BadRequestError(
            f"{where}.input_audio.format must be one of {sorted(INPUT_AUDIO_FORMATS)}, got {fmt!r}", param="messages"
        )
    unknown = sorted(set(value) - {"data", "format"})
    if unknown:
        raise BadRequestError(f"{where}.input_audio has unknown fields {unknown}", param="messages")
    return f"data:{INPUT_AUDIO_FORMATS[fmt]};base64,{data}"
