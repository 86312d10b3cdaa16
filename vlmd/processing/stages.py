"""Where one request's preprocessing time goes, stage by stage (filled on its thread).

The front end turns these, with the engine's ``EngineTimings``, into the request's stage
table (``vlmd/server/stages.py``): ``/metrics`` histograms and, under
``--log-request-stages``, one log line per request. Stamps are ``time.perf_counter()``,
the clock every thread of the process shares.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from vlmd.media.image import DECODED_PIXELS

# The work of a preprocessing thread, in the order it runs; what they leave of the
# thread's time (identifiers, the media lease, remote encoders) is ``preprocess_other``.
THREAD_STAGES = ("render", "fetch", "decode", "process")


@dataclass
class PreprocessStages:
    submitted: float = 0.0  # handed to the pool
    started: float = 0.0  # a thread took it
    ended: float = 0.0  # the thread finished it
    seconds: dict[str, float] = field(default_factory=dict)  # THREAD_STAGES' durations
    # Pixels of image decodes that ran whole while the request waited for the event loop or
    # for a thread, at least (``media/image.py:DecodedPixels``, D116): from its arrival to the
    # pool, in the pool's queue, from its thread's end to the engine, from its first token to
    # the loop. 0 when no decode held it up.
    pixels_waited: int = 0
    # DecodedPixels.begun where the wait now under way began (created: the request's arrival).
    waiting_since: int = field(default_factory=lambda: DECODED_PIXELS.begun)

    def wait_begins(self) -> None:
        self.waiting_since = DECODED_PIXELS.begun

    def wait_ends(self, begun: int | None = None) -> None:
        """The wait begun at ``wait_begins`` (or at ``begun``, a DecodedPixels.begun) ends now."""
        since = self.waiting_since if begun is None else begun
        self.pixels_waited += max(0, DECODED_PIXELS.finished - since)

    @contextmanager
    def stage(self, name: str):
        """Adds the time of the block to stage ``name`` (also when it raises)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


class _NoStages(PreprocessStages):
    """Where nobody asked for the stages (``vlmd cost``, the encoder route): not timed."""

    @contextmanager
    def stage(self, name: str):
        yield


NO_STAGES = _NoStages()
