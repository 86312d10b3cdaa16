"""Cutting long audio into encoder windows, at quiet points rather than mid-word.

Each window is at most ``max_seconds`` long. Where a cut is needed, it is placed at the
quietest short frame (lowest RMS energy, 20 ms frames) in the last ``search_seconds`` of the
window, so a word is rarely split between two windows that are decoded independently.
Windows cover the audio without gaps or overlap, so timestamps stay consistent: a window's
segment times plus its start are times in the upload.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FRAME_SECONDS = 0.02


@dataclass(frozen=True)
class Window:
    start: int  # first sample
    end: int  # one past the last sample

    def seconds(self, rate: int) -> tuple[float, float]:
        return self.start / rate, self.end / rate


def split_at_quiet_points(samples: np.ndarray, rate: int, max_seconds: float, search_seconds: float = 5.0) -> list[Window]:
    """Windows of at most ``max_seconds`` covering ``samples`` in order."""
    if max_seconds <= 0 or not 0 <= search_seconds < max_seconds:
        raise ValueError("need max_seconds > search_seconds >= 0")
    total = samples.shape[0]
    max_length = int(max_seconds * rate)
    frame = max(1, int(FRAME_SECONDS * rate))
    windows: list[Window] = []
    start = 0
    while total - start > max_length:
        end = start + max_length
        search_start = max(start + 1, end - int(search_seconds * rate))
        windows.append(Window(start, _quietest_cut(samples, search_start, end, frame)))
        start = windows[-1].end
    if start < total or not windows:
        windows.append(Window(start, total))
    return windows


def _quietest_cut(samples: np.ndarray, lo: int, hi: int, frame: int) -> int:
    """The middle of the quietest frame between ``lo`` and ``hi`` (``hi`` if there is no room)."""
    count = (hi - lo) // frame
    if count < 1:
        return hi
    region = samples[hi - count * frame : hi].astype(np.float64).reshape(count, frame)
    energy = np.sqrt(np.mean(region * region, axis=1))
    # Latest of the quietest frames: windows stay as long as possible.
    quietest = count - 1 - int(np.argmin(energy[::-1]))
    return hi - (count - 1 - quietest) * frame - frame // 2  # the middle of that frame
