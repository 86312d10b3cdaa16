"""M-RoPE positions of a Qwen3-VL prompt: three rows (time, height, width) per token.

transformers' ``Qwen3VLModel.get_rope_index``, token for token:
- Text tokens count up by one in all three rows: (p, p, p).
- Each run of an item's placeholders (an image; each frame pair of a video, which its
  timestamp text separates from the next) gets ``start + (0, row, col)`` in merged-patch
  units, ``start`` being the next text position: time is not a position, the timestamp
  text says when a frame is.
- The text after a run resumes at ``start + max(rows, cols)``.
- Generated tokens continue at ``index + delta`` in all rows, with
  ``delta = max(position) + 1 - len(prompt)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vlmd.types import MultiModalItem
# A request's family state (its prompt's table and the delta that continues it) is Qwen2-VL's:
# only the rule that fills the table differs.
from vlmd_qwen2_vl.positions import MRopeState as PositionTable

__all__ = ["PositionTable", "qwen3_vl_positions"]


def qwen3_vl_positions(token_ids: Sequence[int], items: Sequence[MultiModalItem],
                       placeholder_ids: set[int], merge_size: int) -> tuple[np.ndarray, int]:
    """(positions ``[3, len(token_ids)]`` int64, delta). ``placeholder_ids``: the image and
    video placeholder tokens; every run of them is one frame of the items, in order."""
    frames = [(int(grid[1]) // merge_size, int(grid[2]) // merge_size)
              for item in sorted(items, key=lambda item: item.offset)
              for grid in [item.encoder_inputs["grid_thw"]] for _ in range(int(grid[0]))]
    ids = np.asarray(token_ids, dtype=np.int64)
    is_placeholder = np.isin(ids, list(placeholder_ids))
    positions = np.empty((3, len(ids)), dtype=np.int64)
    cursor, next_position, frame = 0, 0, 0
    while cursor < len(ids):
        run_end = cursor + 1
        while run_end < len(ids) and is_placeholder[run_end] == is_placeholder[cursor]:
            run_end += 1
        if not is_placeholder[cursor]:
            positions[:, cursor:run_end] = np.arange(next_position, next_position + run_end - cursor)
            next_position += run_end - cursor
        else:
            if frame >= len(frames):
                raise ValueError("the prompt has more placeholder runs than its items have frames")
            rows, cols = frames[frame]
            if rows * cols != run_end - cursor:
                raise ValueError(f"a placeholder run of {run_end - cursor} tokens where a {rows}x{cols} frame goes")
            row, col = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
            positions[0, cursor:run_end] = next_position
            positions[1, cursor:run_end] = row.ravel() + next_position
            positions[2, cursor:run_end] = col.ravel() + next_position
            next_position += max(rows, cols)
            frame += 1
        cursor = run_end
    if frame != len(frames):
        raise ValueError(f"the prompt's placeholders fill {frame} of its items' {len(frames)} frames")
    largest = int(positions.max()) if len(ids) else -1
    return positions, largest + 1 - len(ids)
