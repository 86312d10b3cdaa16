"""A language server's client of its encoder servers (``--encoder-urls``).

Runs on the preprocessing pool, after the request's own processing gave its items (the
prompt's placeholders and the identifiers need nothing of the encoder): the items whose
encoder output this server does not hold are sent, as the request's own media parts, to one
encoder server, which fetches, decodes and processes them under its own bounds and answers
their encoder outputs keyed by identifier (``vlmd/encoder_wire.py``). Each output is checked
against the item it is for (identifier, modality, encoder tokens) and attached to it
(``MultiModalItem.encoder_output``); the runner stores it instead of encoding.

A server that fails (refused connection, an error status, slower than
``--encoder-timeout-s``, a body that does not parse or does not match) is passed over for
the next URL, and is left out for the next ``REST_AFTER_FAILURE_S`` unless every server
is. When all have failed the items keep no output and the runner encodes them
here (``--encoder-fallback local``), or the request alone fails with a 503 that names each
server's failure (``fail``). Identifiers cover the model and the processor kwargs, so a
server configured differently answers outputs that match nothing: a failure, never a
wrong answer.
"""

from __future__ import annotations

import http.client
import itertools
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import orjson
import structlog

from vlmd.encoder_wire import MEDIA_TYPE, WireFormatError, unpack
from vlmd.errors import ServiceUnavailableError
from vlmd.processing.chat import MediaRef
from vlmd.processing.deadline import NO_DEADLINE, Deadline
from vlmd.processing.encoder_tensors import from_wire
from vlmd.types import MultiModalItem

log = structlog.get_logger(__name__)

ROUTE = "/v1/encoder_outputs"
_PART_KEYS = {"image": "image_url", "video": "video_url", "audio": "audio_url"}
_READ_CHUNK = 1 << 20
# Bytes of header and padding an answer may hold besides its tensors' data.
_HEADER_SLACK = 1 << 20
# A server that failed is left out this long: a dead or hung encoder then costs one request
# a timeout, not every request until it is back.
REST_AFTER_FAILURE_S = 10.0


class EncoderServerFailed(Exception):
    """One encoder server's failure, in words fit for the request's error. ``rests``: whether
    the server is left out for a while (not when it refused these items with a 4xx: it is
    up, and other items may suit it)."""

    def __init__(self, message: str, rests: bool = True):
        super().__init__(message)
        self.rests = rests


def media_part(ref: MediaRef) -> dict:
    """The chat content part that names ``ref``'s media (the encoder route reads these)."""
    key = _PART_KEYS[ref.modality]
    return {"type": key, key: {"url": ref.url}}


class RemoteEncoders:
    def __init__(self, urls: tuple[str, ...], model: str, timeout_s: float, fallback: str,
                 output_width: int, api_key: str | None = None,
                 is_resident: Callable[[str], bool] | None = None):
        """``output_width``: values per encoder-output vector (the processing info's
        ``encoder_output_width``), which bounds an answer's size. ``is_resident(identifier)``:
        whether the engine holds that output already (then the item is not sent; should it
        be evicted before its step, the runner encodes it here)."""
        self.urls = urls
        self.model = model
        self.timeout_s = timeout_s
        self.fallback = fallback
        self.output_width = output_width
        self.api_key = api_key
        self.is_resident = is_resident or (lambda identifier: False)
        self._turn = itertools.count()  # spreads requests over the servers, one after another
        # A failed server's URL -> (when it is asked again, why it failed).
        self._resting: dict[str, tuple[float, str]] = {}

    def _order(self) -> list[str]:
        """This request's URLs, the next in turn first, leaving out those that failed in the
        last ``REST_AFTER_FAILURE_S`` (a circuit breaker's open state); all of them when every
        one is resting (so a server that is back is found)."""
        first = next(self._turn)
        turns = [self.urls[(first + turn) % len(self.urls)] for turn in range(len(self.urls))]
        now = time.monotonic()
        awake = [url for url in turns if self._resting.get(url, (0.0, ""))[0] <= now]
        return awake or turns

    def attach(self, items: list[MultiModalItem], refs: list[MediaRef], mm_processor_kwargs: dict | None,
               deadline: Deadline = NO_DEADLINE) -> int:
        """Attach remote encoder outputs to ``items`` (``refs[i]`` is ``items[i]``'s media);
        returns how many items got one."""
        wanted: dict[str, tuple[MultiModalItem, MediaRef]] = {}
        if len(items) == len(refs):  # one item per media part (else the items are encoded here)
            for item, ref in zip(items, refs):
                if item.identifier not in wanted and ref.modality in _PART_KEYS and not self.is_resident(item.identifier):
                    wanted[item.identifier] = (item, ref)
        if not wanted:
            return 0
        body = {"model": self.model, "items": [media_part(ref) for _, ref in wanted.values()]}
        if mm_processor_kwargs:
            body["mm_processor_kwargs"] = mm_processor_kwargs
        payload = orjson.dumps(body)
        limit = _HEADER_SLACK + sum(4 * item.num_encoder_tokens * self.output_width for item, _ in wanted.values())
        failures = []
        order = self._order()
        for url in order:
            try:
                outputs = self._ask(url, payload, limit, deadline)
                attached = self._match(wanted, outputs)
            except (EncoderServerFailed, WireFormatError, OSError, http.client.HTTPException) as exc:
                reason = str(exc) or type(exc).__name__
                log.warning("encoder server failed", url=url, reason=reason)
                failures.append(f"{url}: {reason}")
                if getattr(exc, "rests", True):
                    self._resting[url] = (time.monotonic() + REST_AFTER_FAILURE_S, reason)
                continue
            self._resting.pop(url, None)
            for item in items:
                item.encoder_output = attached.get(item.identifier)
            return len(attached)
        for url in self.urls:
            resting = self._resting.get(url)  # other threads update it: read each entry once
            if url not in order and resting is not None:
                failures.append(f"{url}: left out, it failed in the last {REST_AFTER_FAILURE_S:g} s ({resting[1]})")
        if self.fallback == "fail":
            raise ServiceUnavailableError(
                "no encoder server computed this request's media (--encoder-fallback fail): " + "; ".join(failures)
            )
        log.warning("encoding locally: every encoder server failed", items=len(wanted))
        return 0

    def _ask(self, url: str, payload: bytes, limit: int, deadline: Deadline) -> dict:
        """POST the items to one server; its answer parsed, within the time both allow."""
        budget = min(self.timeout_s, deadline.remaining_s)
        if budget <= 0:
            raise EncoderServerFailed("no time left in --preprocess-timeout")
        expires = time.monotonic() + budget
        parts = urlsplit(url)
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(parts.netloc, timeout=budget)
        headers = {"Content-Type": "application/json", "Accept": MEDIA_TYPE, "User-Agent": "vlmd"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            connection.request("POST", parts.path.rstrip("/") + ROUTE, body=payload, headers=headers)
            response = connection.getresponse()
            chunks, size = [], 0
            while chunk := response.read(_READ_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise EncoderServerFailed(f"its answer is larger than the {limit} bytes these items' outputs take")
                if time.monotonic() > expires:
                    raise EncoderServerFailed(f"it took longer than {budget:.3g} s (--encoder-timeout-s)")
                chunks.append(chunk)
        except TimeoutError:
            raise EncoderServerFailed(f"it took longer than {budget:.3g} s (--encoder-timeout-s)") from None
        finally:
            connection.close()
        body = b"".join(chunks)
        if response.status != 200:
            raise EncoderServerFailed(f"it answered {response.status}: {_error_message(body)}",
                                      rests=not 400 <= response.status < 500)
        model, tensors = unpack(body)
        if model != self.model:
            raise EncoderServerFailed(f"it serves the model {model!r}, not {self.model!r}")
        return tensors

    @staticmethod
    def _match(wanted: dict, outputs: dict) -> dict:
        """Each wanted item's output, checked against the item; any mismatch fails the server."""
        attached = {}
        for identifier, (item, _) in wanted.items():
            output = outputs.get(identifier)
            if output is None:
                raise EncoderServerFailed(
                    f"it sent no output for {item.modality} item {identifier[:12]} (is it serving the same model "
                    "with the same --mm-processor-kwargs and --media-io-kwargs?)")
            if output.modality != item.modality or output.shape[0] != item.num_encoder_tokens:
                raise EncoderServerFailed(
                    f"its output for {item.modality} item {identifier[:12]} is {output.modality} of shape "
                    f"{list(output.shape)}; the item takes {item.num_encoder_tokens} encoder tokens")
            attached[identifier] = from_wire(output)
        return attached


def _error_message(body: bytes) -> str:
    """An error answer's message (OpenAI-shaped JSON), short."""
    try:
        message = orjson.loads(body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body[:200].decode("utf-8", "replace")
    return str(message)[:300]
