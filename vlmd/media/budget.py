"""A budget over the bytes of decoded media held by requests in flight.

Each item passes its own bounds (bytes, pixels, frames, seconds), but N such items at once
could still exhaust memory: every request takes a lease, holds each item's decoded bytes on
it before the next item is decoded, and gives them back when it ends. Beyond the budget a
request gets 503 (retry later: others will finish); an item larger than the whole budget
gets 413 (it can never fit). Thread-safe: leases are filled on preprocessing threads and
released on the event loop.
"""

from __future__ import annotations

import threading

from vlmd.errors import PayloadTooLargeError, ServiceUnavailableError


class MediaBudget:
    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self._lock = threading.Lock()

    def lease(self) -> "MediaLease":
        return MediaLease(self)

    def _take(self, nbytes: int, what: str) -> None:
        with self._lock:
            if nbytes > self.limit_bytes:
                raise PayloadTooLargeError(
                    f"{what} decodes to {nbytes} bytes, more than the {self.limit_bytes} bytes all requests "
                    f"in flight may hold (--max-inflight-media-gb)", param="messages")
            if self.used_bytes + nbytes > self.limit_bytes:
                raise ServiceUnavailableError(
                    f"the server holds {self.used_bytes} bytes of decoded media for requests in flight; "
                    f"{what} ({nbytes} bytes) would pass the budget of {self.limit_bytes} "
                    f"(--max-inflight-media-gb): retry later")
            self.used_bytes += nbytes

    def _give(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes -= nbytes


class MediaLease:
    """One request's share of the budget; ``release`` is idempotent."""

    def __init__(self, budget: MediaBudget):
        self.budget = budget
        self.held_bytes = 0

    def hold(self, nbytes: int, what: str) -> None:
        self.budget._take(nbytes, what)
        self.held_bytes += nbytes

    def settle(self, nbytes: int) -> None:
        """After processing: what the request keeps until it ends (its encoder inputs),
        replacing the decoded bytes. Never refused: the work is done."""
        with self.budget._lock:
            self.budget.used_bytes += nbytes - self.held_bytes
        self.held_bytes = nbytes

    def release(self) -> None:
        held, self.held_bytes = self.held_bytes, 0
        if held:
            self.budget._give(held)

    def __enter__(self) -> "MediaLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def decoded_nbytes(media) -> int:
    """Bytes of a decoded item: a PIL image, or an array (video frames, audio samples)."""
    nbytes = getattr(media, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    size, bands = getattr(media, "size", None), getattr(media, "getbands", None)
    if size is not None and bands is not None:
        return int(size[0]) * int(size[1]) * len(bands())
    return 0


def encoder_input_nbytes(items) -> int:
    """Bytes of the arrays processed items hold until their request ends."""
    return sum(int(getattr(value, "nbytes", 0)) for item in items for value in item.encoder_inputs.values())
