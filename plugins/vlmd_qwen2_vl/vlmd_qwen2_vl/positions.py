"""M-RoPE positions of a Qwen2-VL prompt: three rows (time, height, width) per token.

- Text tokens count up by one in all three rows: (p, p, p).
- An item's placeholders, in the order the merger emits them (frame pair, row, column), get
  ``start + (t, row, col)`` in merged-patch units, ``start`` being the next text position.
- The text after an item resumes one past the largest position the item used.
- Generated tokens continue at ``index + delta`` in all rows, with
  ``delta = max(position) + 1 - len(prompt)`` (zero or negative: an item spans fewer
  positions than tokens).

This is the original Qwen2-VL rule (and vLLM's). transformers 5.24's ``get_rope_index``
resumes text at ``start + max(rows, cols)`` instead, which differs only for a video with more
frame pairs than merged rows and columns (``t > max(h, w)``); there the two disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vlmd.types import MultiModalItem


@dataclass(frozen=True)
class MRopeState:
    """A Qwen2-VL request's family state (vlmd's processor -> model seam): its prompt's
    position table and the delta that continues it for generated tokens."""

    table: np.ndarray  # [3, len(prompt)] int64
    delta: int

    def positions(self, start: int, end: int, num_prompt_tokens: int) -> torch.Tensor:
        """[3, end - start] positions of tokens [start, end): the table's for prompt
        tokens, ``index + delta`` in every row after them."""
        prompt_end = min(end, num_prompt_tokens)
        parts = []
        if start < prompt_end:
            parts.append(torch.as_tensor(self.table[:, start:prompt_end], dtype=torch.long))
        first_generated = max(start, prompt_end)
        if first_generated < end:
            parts.append(torch.arange(first_generated, end).add_(self.delta).expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def mrope_positions(
    num_tokens: int, items: Sequence[MultiModalItem], grids: Sequence[tuple[int, int, int]], merge_size: int,
    time_intervals: Sequence[float] | None = None,
) -> tuple[np.ndarray, int]:
    """(positions ``[3, num_tokens]`` int64, delta) for a prompt whose items have these
    ``grid_thw`` patch grids (one per item, in the items' order). ``time_intervals``, one per
    item, stretch the time row (Qwen2.5-VL's absolute time; 1 everywhere for Qwen2-VL)."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    cursor = 0  # next token index
    next_position = 0
    intervals = [1.0] * len(items) if time_intervals is None else time_intervals
    for item, grid, interval in sorted(zip(items, grids, intervals), key=lambda triple: triple[0].offset):
        text = item.offset - cursor
        positions[:, cursor : item.offset] = np.arange(next_position, next_position + text)
        next_position += text
        block = item_positions(grid, merge_size, interval)
        if block.shape[1] != item.length:
            raise ValueError(
                f"{item.modality} item has {item.length} placeholders but its grid {tuple(grid)} "
                f"gives {block.shape[1]} positions"
            )
        positions[:, item.offset : item.end] = block + next_position
        next_position += int(block.max()) + 1
        cursor = item.end
    positions[:, cursor:] = np.arange(next_position, next_position + num_tokens - cursor)
    largest = int(positions.max()) if num_tokens else -1
    return positions, largest + 1 - num_tokens


def item_positions(grid: tuple[int, int, int], merge_size: int, time_interval: float = 1.0) -> np.ndarray:
    """``[3, t * h * w / merge**2]`` offsets (t, row, col) of one item, from zero; frame pair
    ``t`` sits at ``int(t * time_interval)``, multiplied in float32 as transformers does."""
    frames, rows, cols = int(grid[0]), int(grid[1]) // merge_size, int(grid[2]) // merge_size
    times = np.arange(frames) if time_interval == 1.0 else (
        np.arange(frames, dtype=np.float32) * np.float32(time_interval)).astype(np.int64)
    t, h, w = np.meshgrid(times, np.arange(rows), np.arange(cols), indexing="ij")
    return np.stack([t.ravel(), h.ravel(), w.ravel()])
