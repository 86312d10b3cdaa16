"""Reading a JSON body with the text bound applied while it streams in.

A body may be up to ``--max-request-bytes`` because media travel inside it as ``data:``
URLs; text may not be nearly that long (vlmd.processing.preprocess: at most the tokenizer's
longest token x max_model_len characters). Reading a 40 MB body whole and parsing it costs
two copies and a full JSON parse on the event loop before the bound can be checked, and
several at once hold the loop for seconds. So a body larger than the bound is scanned as it
arrives, at C speed (``bytes.find``): a run of bytes between two double quotes that is
longer than ``max_run_bytes`` and does not start like a data URL is text (or structure)
longer than any prompt can be, and is refused at once; the rest of the body is discarded
by aiohttp, which still lets the client finish sending and read the answer. Bodies that pass
are parsed as usual and the exact character bound is checked on the parsed messages.
(A string's escapes only split runs, so the scan can only miss, never refuse wrongly.)

Every JSON body's values are counted the same way, as it arrives: its commas and opening
brackets, a bound from above on the values a parse would make (a comma inside a string only
counts one more). Parsing takes the event loop's thread and the GIL for the whole parse,
~1 us a value: a 57 MB ``tools`` list made ~9.7 s of it, and /health waited 2.5 s. Past
``--max-request-json-values`` the body is refused (400) while it streams, never parsed (D110).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from vlmd.errors import BadRequestError, RequestTimeoutError
from vlmd.server.admission import BodyAccount

_DATA = b"data:"
# OpenAI's ``input_audio`` carries its clip as bare base64 under the key ``data``: the run
# of a string value whose key is "data" is media too (a text field of that name is refused by
# the strict parser after the parse, and a word there fails the audio decoder, also a 400).
_DATA_KEY = b"data"
# vLLM's ``image_embeds`` part carries its tensor as bare base64 under that key: media too.
_EMBEDS_KEY = b"image_embeds"
_HEAD = 12  # bytes kept of each run: enough to tell a data URL, a key and the colon after it


class _RunScanner:
    def __init__(self, max_run_bytes: int, describe: str):
        self.max_run_bytes = max_run_bytes
        self.describe = describe
        self.run = 0  # bytes since the last double quote
        self.head = b""  # the run's first bytes, to tell a data URL
        self.seen_quote = False
        self.previous: tuple[bytes | None, bytes | None] = (None, None)  # the two runs before, if short

    def _boundary(self) -> None:
        """A double quote: the run ends (remembered if short, as a possible key) and another starts."""
        if self.seen_quote:
            self.previous = (self.previous[1], self.head if self.run <= _HEAD else None)
        self.run, self.head, self.seen_quote = 0, b"", True

    def _is_media(self) -> bool:
        if self.head.lower().startswith(_DATA):
            return True
        key, between = self.previous
        return key in (_DATA_KEY, _EMBEDS_KEY) and between is not None and between.strip() == b":"

    def feed(self, chunk: bytes) -> None:
        parts = chunk.split(b'"')
        if len(parts) == 1:
            self._extend(chunk)
            return
        self._extend(parts[0])
        inner = parts[1:-1]
        # Whether a run between two of its quotes is too long, at C speed: a chunk of JSON
        # structure holds a quote every few bytes, and a step per quote in Python held the
        # loop ~250 ms for each 768 KB of a tools list (D110).
        if inner and max(map(len, inner)) > self.max_run_bytes:
            for piece in inner:
                self._boundary()
                self._extend(piece)
        else:  # the runs between this chunk's quotes are short: remember only the last two
            for piece in inner[-2:]:
                self._boundary()
                self._extend(piece)
        self._boundary()
        self._extend(parts[-1])

    def _extend(self, piece: bytes) -> None:
        if len(self.head) < _HEAD:
            self.head += piece[: _HEAD - len(self.head)]
        self.run += len(piece)
        if self.run > self.max_run_bytes and self.seen_quote and not self._is_media():
            raise BadRequestError(
                f"the body holds a run of more than {self.max_run_bytes} bytes outside any data: URL "
                f"or input_audio data, so {self.describe}", param="messages")


async def within_read_deadline(request: web.Request, reading):
    """Await ``reading`` (a coroutine reading the body) within the read deadline: a client
    that trickles its body, or sends less than its Content-Length and waits, gets a 408
    instead of holding the connection (and a pool slot) for as long as it likes. The deadline
    is --request-read-timeout after the headers plus 1/--request-min-body-rate s for each byte
    received so far: a 60 MB upload at a steady 1 MB/s is read, a stall is cut off within
    the time the bytes already sent have bought."""
    config = request.app["state"].config
    timeout, rate = config.request_read_timeout, config.request_min_body_rate
    loop = asyncio.get_running_loop()
    started = loop.time()
    task = asyncio.ensure_future(reading)
    try:
        while True:
            remaining = started + timeout + request.content.total_bytes / rate - loop.time()
            if remaining <= 0:
                raise RequestTimeoutError(
                    f"the request body did not arrive in time: {timeout:g} s (--request-read-timeout) plus 1 s "
                    f"per {rate} bytes received (--request-min-body-rate)")
            done, _ = await asyncio.wait({task}, timeout=remaining)
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()


async def read_body(request: web.Request, account: BodyAccount, max_run_bytes: int | None = None,
                    describe: str = "", max_values: int | None = None) -> bytearray:
    """The body, within the read deadline, each chunk charged to ``account`` as it arrives
    (413 past the route's bound, 503 past the bodies-in-flight budget: D97), refused early
    (400) when a run outside data URLs passes ``max_run_bytes`` or its JSON values (counted
    from above) pass ``max_values``."""
    return await within_read_deadline(request, _read_body(request, account, max_run_bytes, describe, max_values))


def json_values_bound(chunk: bytes) -> int:
    """What ``chunk`` adds to a bound from above on a JSON text's values: each value but a
    container's first follows a comma, and each container's first follows its opening bracket."""
    return chunk.count(b",") + chunk.count(b"[") + chunk.count(b"{")


async def _read_body(request: web.Request, account: BodyAccount, max_run_bytes: int | None,
                     describe: str, max_values: int | None = None) -> bytearray:
    length = request.content_length
    scan = max_run_bytes is not None and (length is None or length > max_run_bytes)
    scanner = _RunScanner(max_run_bytes, describe) if scan else None
    # Grown as bytes arrive (not allocated at the declared size): memory follows what was
    # received and charged, so a body declared large and never sent costs nothing.
    buffer = bytearray()
    values = 1
    async for chunk in request.content.iter_any():
        account.received(len(buffer) + len(chunk))
        buffer += chunk
        if scanner is not None:
            scanner.feed(chunk)
        if max_values is not None:
            values += json_values_bound(chunk)
            if values > max_values:
                raise BadRequestError(
                    f"the request body holds more than {max_values} JSON values (its commas and opening brackets; "
                    "--max-request-json-values): more than any request needs, and too many to parse without "
                    "holding up other requests")
    return buffer
