"""The one error vocabulary: what a client sees when a request does not succeed.

Three kinds, wherever they are detected (parser, preprocessor, scheduler, engine step):
- the client's fault: a 4xx ``VlmdError`` subclass (400, 401, 404, 413) that says what to fix;
- overload: ``ServiceUnavailableError`` (503) with ``Retry-After``: the same request may
  succeed later;
- the server's fault: ``ServerError`` (500, ``server_error``) naming the request id, so an
  operator can find the logged cause; no internals reach the client.

``as_client_error`` is the one place an arbitrary exception becomes one of these, and
``from_engine`` the one place an engine-side failure (carried as plain data in a
``RequestDelta``) does. The HTTP layer only renders: ``to_dict()`` as the JSON body (or an
SSE data line once a stream has started) and ``headers``. Torch-free.
"""

from __future__ import annotations

import re

# Where a library's message turns into its internals: a Rust panic's backtrace (llguidance
# put one, frames and all, in a 400's body: issue 36), a Python traceback, or a frame list.
_INTERNALS = re.compile(r"\n?\s*(stack backtrace:|Traceback \(most recent call last\)|note: run with `RUST_BACKTRACE"
                        r"|\n\s*\d+:\s+0x[0-9a-f]+|\n\s*at \S+\.rs:\d+)")
_PANIC_LOCATION = re.compile(r"panicked at \S+:\d+:\d+:\s*")  # a Rust source file and line
MESSAGE_LIMIT = 1000  # characters of a message a client is shown


def client_message(message: str) -> str:
    """``message`` as a client may see it: cut where a backtrace or frame list starts, and
    at ``MESSAGE_LIMIT`` characters (a library's message may quote the whole input)."""
    found = _INTERNALS.search(message)
    if found is not None:
        message = message[: found.start()].rstrip()
    message = _PANIC_LOCATION.sub("", message)
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 1].rstrip() + "\u2026"
    return message or "the request failed; the server's log has the details"


class VlmdError(Exception):
    """Base class: a client-visible error with an HTTP status. ``message`` is what the
    client sees (``client_message``: no internals); ``detail`` the text as raised, for
    the log."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.detail = message
        self.message = client_message(message)
        self.param = param
        self.code = code

    @property
    def headers(self) -> dict[str, str]:
        return {}

    def to_dict(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


class BadRequestError(VlmdError):
    status = 400


class RequestRejected(BadRequestError, ValueError):
    """A limit the engine checks when a request arrives (prompt length, an item larger
    than the encoder budget): still the client's input, so still a 400. A ValueError too,
    so the scheduler's direct callers (tests, warm-up) need not know this module."""

    def __init__(self, message: str, *, param: str | None = "messages"):
        super().__init__(message, param=param)


class MediaError(BadRequestError):
    """Media that cannot be fetched, is refused by policy, or cannot be decoded."""


class AuthenticationError(VlmdError):
    status = 401
    type = "authentication_error"


class NotFoundError(VlmdError):
    status = 404
    type = "not_found_error"


class PayloadTooLargeError(VlmdError):
    status = 413


class RequestTimeoutError(VlmdError):
    """A body that did not arrive within the read deadline (a trickle, or a Content-Length
    the client never sends): 408, and the connection is closed."""

    status = 408


class ServiceUnavailableError(VlmdError):
    """Overload: the server is healthy but full; the client should retry after a pause."""

    status = 503
    type = "service_unavailable_error"

    def __init__(self, message: str, *, retry_after_s: int = 1, param: str | None = None):
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ServerError(VlmdError):
    """The server failed this request (a bug, a poisoned step): 500 with the request id."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, *, request_id: str | None = None):
        where = f" (request id {request_id})" if request_id else ""
        super().__init__(f"{message}{where}")
        self.request_id = request_id


class HttpError(VlmdError):
    """A condition aiohttp itself detected (no route, wrong method, body too large), in
    the same shape as every other error."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.type = kind
        self._headers = dict(headers or {})

    @property
    def headers(self) -> dict[str, str]:
        return self._headers


# How an engine-side failure is marked in a RequestDelta (plain data, no exception objects
# cross the engine boundary): the HTTP status it maps to.
ENGINE_REJECTED = 400  # refused on arrival (RequestRejected), or its grammar could not be followed
ENGINE_FAILED = 500  # a step that computed this request raised


def from_engine(message: str | None, status: int | None, request_id: str) -> VlmdError:
    if status is not None and 400 <= status < 500:
        return BadRequestError(message or "the engine refused the request", param="messages")
    return ServerError(message or "engine error", request_id=request_id)


def as_client_error(exc: BaseException, request_id: str | None = None) -> VlmdError:
    """Any exception as what the client may see: a VlmdError passes through; anything else is
    a server fault, reported without its internals."""
    if isinstance(exc, VlmdError):
        return exc
    return ServerError("internal server error", request_id=request_id)
