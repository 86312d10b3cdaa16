"""Reading a /v1/audio/* multipart form (OpenAI's fields) into a plain request object.

The body is streamed part by part, so its size is bounded here rather than by aiohttp's
``client_max_size`` (which only covers bodies read whole): the file part may not exceed the
audio upload bound (413), every other field is a few kilobytes at most, and the whole form
``max_form_bytes`` (each chunk is charged to the body's account as it arrives, D97).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from vlmd.errors import BadRequestError, PayloadTooLargeError
from vlmd.processing.temperature_fallback import FallbackThresholds
from vlmd.server.admission import BodyAccount
from vlmd.server.request_fields import field_param, unsupported_field_message

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("segment", "word")
TIMESTAMP_FORMATS = ("srt", "verbose_json", "vtt")
MAX_FIELD_BYTES = 64 * 1024
MAX_LANGUAGE_CHARACTERS = 32
# The whole form besides its file: the fields and the multipart framing.
FORM_FIELDS_BYTES = 1 << 20
# vlmd's extensions: openai-whisper's fallback thresholds, per request ("none" turns one off).
THRESHOLD_FIELDS = ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold")
_TEXT_FIELDS = ("model", "language", "prompt", "response_format", "temperature", "stream", "seed", *THRESHOLD_FIELDS)
_LIST_FIELDS = ("timestamp_granularities", "include")


@dataclass
class TranscriptionForm:
    file: bytes
    filename: str
    model: str
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    stream: bool = False
    seed: int | None = None
    thresholds: FallbackThresholds = FallbackThresholds()
    given_fields: tuple[str, ...] = ()  # the text fields the client sent
    # timestamp_granularities[]: none given means segments, as OpenAI's API answers.
    granularities: frozenset[str] = frozenset()

    @property
    def words(self) -> bool:
        return "word" in self.granularities

    @property
    def segments(self) -> bool:
        """Whether verbose_json lists segments: asked for, or no granularity asked at all."""
        return not self.granularities or "segment" in self.granularities

    @property
    def thresholds_given(self) -> bool:
        return any(name in self.given_fields for name in THRESHOLD_FIELDS)

    @property
    def timestamps(self) -> bool:
        return self.response_format in TIMESTAMP_FORMATS


def max_form_bytes(max_file_bytes: int) -> int:
    """The largest body the form may be: its file at the upload bound and its other fields."""
    return max_file_bytes + FORM_FIELDS_BYTES


async def read_transcription_form(request: web.Request, max_file_bytes: int, account: BodyAccount) -> TranscriptionForm:
    if not request.content_type.startswith("multipart/form-data"):
        raise BadRequestError("the body must be multipart/form-data with a 'file' part (OpenAI's audio API)")
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as exc:
        raise BadRequestError(f"malformed multipart body: {exc}") from None
    fields: dict[str, str] = {}
    lists: dict[str, list[str]] = {}
    upload: tuple[bytes, str] | None = None

    def received() -> None:  # the body's bytes so far, as the connection's stream counts them
        account.received(request.content.total_bytes)

    while True:
        try:
            part = await reader.next()
        except ValueError as exc:
            raise BadRequestError(f"malformed multipart body: {exc}") from None
        if part is None:
            break
        name = (part.name or "").removesuffix("[]")
        if name == "file":
            if upload is not None:
                raise BadRequestError("send exactly one 'file'", param="file")
            upload = (await _read_limited(part, max_file_bytes, "file", received), part.filename or "")
        elif name in _TEXT_FIELDS or name in _LIST_FIELDS:
            value = (await _read_limited(part, MAX_FIELD_BYTES, name, received)).decode("utf-8", errors="replace")
            if name in _LIST_FIELDS:
                lists.setdefault(name, []).append(value)
            elif name in fields:
                raise BadRequestError(f"'{name}' is given twice", param=name)
            else:
                fields[name] = value
        else:
            # A field we would ignore gives wrong output without a word: refuse it by name.
            raise BadRequestError(unsupported_field_message(name), param=field_param(name))
    if upload is None:
        raise BadRequestError("'file' is required: the audio to transcribe", param="file")
    return _validated(upload, fields, lists)


async def _read_limited(part, limit: int, name: str, received: Callable[[], None]) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = await part.read_chunk(64 * 1024)
        received()
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            if name == "file":
                raise PayloadTooLargeError(f"the audio file is larger than the limit of {limit} bytes", param="file")
            raise BadRequestError(f"'{name}' is longer than {limit} bytes", param=name)
        chunks.append(chunk)


def _validated(upload: tuple[bytes, str], fields: dict[str, str], lists: dict[str, list[str]]) -> TranscriptionForm:
    model = fields.get("model", "").strip()
    if not model:
        raise BadRequestError("'model' is required", param="model")
    response_format = fields.get("response_format", "json").strip() or "json"
    if response_format not in RESPONSE_FORMATS:
        raise BadRequestError(f"'response_format' must be one of {list(RESPONSE_FORMATS)}", param="response_format")
    granularities = {value.strip() for value in lists.get("timestamp_granularities", [])}
    if granularities - set(GRANULARITIES):
        raise BadRequestError(f"timestamp_granularities[] takes {' and/or '.join(GRANULARITIES)}, "
                              f"not {sorted(granularities - set(GRANULARITIES))}", param="timestamp_granularities")
    if granularities and response_format != "verbose_json":
        raise BadRequestError("timestamp_granularities needs response_format verbose_json",
                              param="timestamp_granularities")
    if set(lists.get("include", [])):
        raise BadRequestError("'include' is not supported", param="include")
    temperature = _number(fields, "temperature", 0.0)
    if not 0.0 <= temperature <= 1.0:
        raise BadRequestError("'temperature' must be between 0 and 1", param="temperature")
    stream = _boolean(fields, "stream")
    if stream and response_format not in ("json", "text"):
        raise BadRequestError("streaming returns text deltas: use response_format json or text", param="stream")
    seed = fields.get("seed")
    if seed is not None and not seed.strip().lstrip("-").isdigit():
        raise BadRequestError("'seed' must be an integer", param="seed")
    thresholds = _thresholds(fields)
    thresholds_given = any(name in fields for name in THRESHOLD_FIELDS)
    if stream and thresholds_given:
        raise BadRequestError("a streamed transcription decodes each window once (sent text cannot be taken back): "
                              "the fallback thresholds apply to non-streamed responses",
                              param=next(name for name in THRESHOLD_FIELDS if name in fields))
    language = fields.get("language", "").strip().lower() or None
    if language is not None and len(language) > MAX_LANGUAGE_CHARACTERS:  # no code or name is this long
        raise BadRequestError(f"'language' takes a language code (ISO-639-1, e.g. en), not a string of "
                              f"{len(language)} characters", param="language")
    prompt = fields.get("prompt")
    return TranscriptionForm(
        file=upload[0], filename=upload[1], model=model, language=language,
        prompt=prompt if prompt and prompt.strip() else None, response_format=response_format,
        temperature=temperature, stream=stream, seed=int(seed) if seed is not None else None,
        thresholds=thresholds, given_fields=tuple(fields), granularities=frozenset(granularities),
    )


def _thresholds(fields: dict[str, str]) -> FallbackThresholds:
    defaults = FallbackThresholds()
    values = {}
    for name, key in zip(THRESHOLD_FIELDS, ("compression_ratio", "logprob", "no_speech")):
        if fields.get(name, "").strip().lower() == "none":
            values[key] = None
            continue
        value = _number(fields, name, getattr(defaults, key))
        if value in (float("inf"), float("-inf")):
            raise BadRequestError(f"'{name}' must be a finite number, or none to turn the test off", param=name)
        values[key] = value
    if values["no_speech"] is not None and not 0.0 <= values["no_speech"] <= 1.0:
        raise BadRequestError("'no_speech_threshold' is a probability: between 0 and 1", param="no_speech_threshold")
    if values["compression_ratio"] is not None and values["compression_ratio"] <= 0:
        raise BadRequestError("'compression_ratio_threshold' must be positive", param="compression_ratio_threshold")
    return FallbackThresholds(**values)


def _number(fields: dict[str, str], name: str, default: float) -> float:
    text = fields.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise BadRequestError(f"'{name}' must be a number", param=name) from None
    if value != value:  # NaN
        raise BadRequestError(f"'{name}' must be a number", param=name)
    return value


def _boolean(fields: dict[str, str], name: str) -> bool:
    text = fields.get(name, "false").strip().lower()
    if text not in ("true", "false", "1", "0", ""):
        raise BadRequestError(f"'{name}' must be true or false", param=name)
    return text in ("true", "1")
