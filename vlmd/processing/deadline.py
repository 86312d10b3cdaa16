"""A preprocessing deadline, checked between stages on the preprocessing thread.

A thread cannot be interrupted in the middle of a C call (the tokenizer, a decoder), so
every stage is bounded on its own (characters before the template and the tokenizer;
bytes, pixels, frames and seconds before and while decoding) and the deadline is checked
between stages: work past ``--preprocess-timeout`` is abandoned at the next boundary. The
event loop answers the client at the deadline itself and marks the deadline abandoned, so
the thread stops at its next check even if it is not yet late by its own clock.
"""

from __future__ import annotations

import time

from vlmd.errors import ServiceUnavailableError


class PreprocessTimeout(ServiceUnavailableError):
    pass


class Deadline:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self._expires_at: float | None = None
        self._abandoned = False

    def start(self) -> None:
        """The clock runs from when a thread takes the work, not while it is queued."""
        self._expires_at = time.monotonic() + self.seconds

    def abandon(self) -> None:
        self._abandoned = True

    @property
    def expired(self) -> bool:
        return self._abandoned or (self._expires_at is not None and time.monotonic() > self._expires_at)

    @property
    def remaining_s(self) -> float:
        """Seconds left (infinite before ``start``; 0 once expired or abandoned): a bound
        for blocking work inside a stage, such as a call to an encoder server."""
        if self._abandoned:
            return 0.0
        if self._expires_at is None:
            return self.seconds
        return max(0.0, self._expires_at - time.monotonic())

    def check(self, next_stage: str) -> None:
        if self.expired:
            raise self.error(f"abandoned before {next_stage}")

    def error(self, detail: str = "the work was abandoned") -> PreprocessTimeout:
        return PreprocessTimeout(
            f"preprocessing this request took longer than {self.seconds:g} s (--preprocess-timeout); {detail}"
        )


NO_DEADLINE = Deadline(float("inf"))
