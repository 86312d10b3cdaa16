"""A language server's client of its encoder servers (``--encoder-urls``).

Runs on the preprocessing pool, after the request's own processing gave its items (the
prompt's placeholders and the identifiers need nothing of the encoder): the items whose
encoder output this server does not hold are sent, as the request's own media parts, to one
encoder server, which fetches, decodes and processes them under its own bounds and answers
their encoder outputs keyed by identifier (``vlmd/encoder_wire.py``). An encoder server is
an untrusted peer: each output is checked against the item it is for (identifier,
modality, shape: encoder tokens *and* width; the dtype is one of the wire's floating types,
checked by its strict parser) and must be finite, before it is attached
(``MultiModalItem.encoder_output``); the runner stores it instead of encoding.

The whole exchange (connect, request, status and headers, body) is bounded by
``--encoder-timeout-s`` (or what is left of the request's preprocess deadline): every send
and receive of the connection waits at most until that one deadline (``_DeadlineSocket``),
so a server that accepts and stays silent, or drips its answer a byte at a time, holds a
preprocessing thread no longer than that.

A server that fails (refused connection, an error status, slower than
``--encoder-timeout-s``, a body that does not parse or does not match) is counted in
``/metrics`` (``vlmd_encoder_server_failures_total`` by reason) and passed over for the
next URL, and is left out for the next ``REST_AFTER_FAILURE_S`` unless every server
is. When all have failed the items keep no output and the runner encodes them
here (``--encoder-fallback local``), or the request alone fails with a 503 that names each
server's failure (``fail``). Identifiers cover the model and the processor kwargs, so a
server configured differently answers outputs that match nothing: a failure, never a
wrong answer.
"""

from __future__ import annotations

import http.client
import io
import itertools
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import orjson
import structlog
import torch

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

    def __init__(self, message: str, rests: bool = True, reason: str = "invalid_answer"):
        super().__init__(message)
        self.rests = rests
        self.reason = reason  # the /metrics label: timeout, error_status or invalid_answer


def media_part(ref: MediaRef) -> dict:
    """The chat content part that names ``ref``'s media (the encoder route reads these)."""
    key = _PART_KEYS[ref.modality]
    return {"type": key, key: {"url": ref.url}}


class RemoteEncoders:
    def __init__(self, urls: tuple[str, ...], model: str, timeout_s: float, fallback: str,
                 output_width: int, api_key: str | None = None,
                 is_resident: Callable[[str], bool] | None = None, observer=None):
        """``output_width``: values per encoder-output vector (the processing info's
        ``encoder_output_width``): each output must have it, and it bounds an answer's size.
        ``is_resident(identifier)``: whether the engine holds that output already (then the
        item is not sent; should it be evicted before its step, the runner encodes it here).
        ``observer``: counts each server's failure by reason (vlmd.server.metrics.Metrics)."""
        self.urls = urls
        self.model = model
        self.timeout_s = timeout_s
        self.fallback = fallback
        self.output_width = output_width
        self.api_key = api_key
        self.is_resident = is_resident or (lambda identifier: False)
        self.observer = observer
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
                if self.observer is not None:
                    self.observer.observe_encoder_server_failure(_failure_kind(exc))
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
        """POST the items to one server; its answer parsed, the whole exchange within the
        time both allow."""
        budget = min(self.timeout_s, deadline.remaining_s)
        if budget <= 0:
            raise EncoderServerFailed("no time left in --preprocess-timeout", reason="timeout")
        late = f"it took longer than {budget:.3g} s (--encoder-timeout-s)"
        parts = urlsplit(url)
        connection_class = _DeadlineHTTPSConnection if parts.scheme == "https" else _DeadlineConnection
        connection = connection_class(parts.netloc, time.monotonic() + budget)
        headers = {"Content-Type": "application/json", "Accept": MEDIA_TYPE, "User-Agent": "vlmd"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        response = None
        try:
            connection.request("POST", parts.path.rstrip("/") + ROUTE, body=payload, headers=headers)
            response = connection.getresponse()
            chunks, size = [], 0
            while chunk := response.read1(_READ_CHUNK):  # what has arrived: a drip cannot hold a read
                size += len(chunk)
                if size > limit:
                    raise EncoderServerFailed(f"its answer is larger than the {limit} bytes these items' outputs take")
                chunks.append(chunk)
        except TimeoutError:
            raise EncoderServerFailed(late, reason="timeout") from None
        finally:
            if response is not None:
                response.close()
            connection.close()
        body = b"".join(chunks)
        if response.status != 200:
            raise EncoderServerFailed(f"it answered {response.status}: {_error_message(body)}",
                                      rests=not 400 <= response.status < 500, reason="error_status")
        model, tensors = unpack(body)
        if model != self.model:
            raise EncoderServerFailed(f"it serves the model {model[:100]!r}, not {self.model!r}")
        return tensors

    def _match(self, wanted: dict, outputs: dict) -> dict:
        """Each wanted item's output, checked against the item; any mismatch fails the server."""
        attached = {}
        for identifier, (item, _) in wanted.items():
            output = outputs.get(identifier)
            if output is None:
                raise EncoderServerFailed(
                    f"it sent no output for {item.modality} item {identifier[:12]} (is it serving the same model "
                    "with the same --mm-processor-kwargs and --media-io-kwargs?)")
            expected_shape = (item.num_encoder_tokens, self.output_width)
            if output.modality != item.modality or tuple(output.shape) != expected_shape:
                raise EncoderServerFailed(
                    f"its output for {item.modality} item {identifier[:12]} is {output.modality} of shape "
                    f"{list(output.shape)}; the item takes {list(expected_shape)} (encoder tokens x width)")
            tensor = from_wire(output)
            if not bool(torch.isfinite(tensor).all()):
                raise EncoderServerFailed(
                    f"its output for {item.modality} item {identifier[:12]} holds values that are not finite")
            attached[identifier] = tensor
        return attached


class _DeadlineSocket:
    """A connected socket whose every send and receive waits at most until ``expires``
    (``time.monotonic()``): what ``http.client`` reads through ``makefile`` is read here, so a
    peer that drips its headers or body a byte at a time meets the deadline of the whole
    exchange, not a fresh timeout per byte."""

    def __init__(self, sock, expires: float):
        self._sock = sock
        self._expires = expires
        # As socket.makefile's readers do: the socket closes once it and its readers all are
        # (http.client closes the connection while the response still reads its body).
        self._readers = 0
        self._closed = False

    def _remaining(self) -> float:
        remaining = self._expires - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the exchange's deadline passed")
        self._sock.settimeout(remaining)
        return remaining

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            self._remaining()
            sent = self._sock.send(view)
            view = view[sent:]

    def recv_into(self, buffer) -> int:
        self._remaining()
        return self._sock.recv_into(buffer)

    def makefile(self, mode: str = "rb", *args, **kwargs):
        if mode != "rb":
            raise ValueError(f"only 'rb' is supported, not {mode!r}")
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self))

    def reader_closed(self) -> None:
        self._readers -= 1
        if self._closed and not self._readers:
            self._sock.close()

    def close(self) -> None:
        self._closed = True
        if not self._readers:
            self._sock.close()


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: _DeadlineSocket):
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._sock.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._sock.reader_closed()
        super().close()


class _Deadline:
    """Makes an ``http.client`` connection's whole exchange due by ``expires``: the connect
    (and a TLS handshake) waits at most what is left, and the socket it makes is a
    ``_DeadlineSocket``."""

    def __init__(self, netloc: str, expires: float):
        super().__init__(netloc, timeout=max(expires - time.monotonic(), 0.001))
        self.expires = expires

    def connect(self) -> None:
        self.timeout = max(self.expires - time.monotonic(), 0.001)
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self.expires)


class _DeadlineConnection(_Deadline, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_Deadline, http.client.HTTPSConnection):
    pass


def _failure_kind(exc: Exception) -> str:
    """The /metrics reason of one server's failure."""
    if isinstance(exc, EncoderServerFailed):
        return exc.reason
    if isinstance(exc, WireFormatError):
        return "invalid_answer"
    return "unreachable"  # refused, reset, closed mid-answer


def _error_message(body: bytes) -> str:
    """An error answer's message (OpenAI-shaped JSON), short."""
    try:
        message = orjson.loads(body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body[:200].decode("utf-8", "replace")
    return str(message)[:300]
