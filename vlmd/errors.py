"""Errors that reach a client as OpenAI-shaped JSON bodies.

Every layer raises these for bad input; the HTTP layer maps them to a status code and
``{"error": {"message", "type", "param", "code"}}``. Anything else is a server bug (500).
"""

from __future__ import annotations


class VlmdError(Exception):
    """Base class: a client-visible error with an HTTP status."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

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


class ServiceUnavailableError(VlmdError):
    status = 503
    type = "service_unavailable_error"
