"""A sequence's cached context as a few contiguous slot ranges instead of a token list.

Attention over a context with no mask does not depend on the order of its keys, so the
blocks of a block table may be visited in any order. Sorting the fully used blocks by id
and merging consecutive ids turns the table into ranges of slots, and each range is a
plain view of the cache (no copy). The partly used last block is a short range of its own,
or extends the range that ends just below it.

The block pool hands out fresh blocks in id order, and reuses freed ones in reverse, so a
table is usually a few long ascending or descending runs: either way one range per run.
Ranges too short to be worth a kernel call each are gathered instead, a bounded chunk at
a time (never the whole context): see ``ContextSegments``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A range shorter than this many tokens is gathered with its neighbours rather than
# attended on its own (each attention call costs ~10-20 us of fixed overhead).
MIN_VIEW_TOKENS = 64
# Gathered slots are attended in pieces of at most this many tokens: the copy stays small
# enough to live in cache between the gather and the attention that reads it.
GATHER_CHUNK_TOKENS = 2048


@dataclass
class ContextSegments:
    views: list[tuple[int, int]] = field(default_factory=list)  # [first slot, end slot)
    gathers: list[torch.Tensor] = field(default_factory=list)  # slot indices, each <= GATHER_CHUNK_TOKENS

    @property
    def count(self) -> int:
        return len(self.views) + len(self.gathers)


def slot_ranges(block_ids: list[int], length: int, block_size: int) -> list[tuple[int, int]]:
    """Slot ranges covering the first ``length`` tokens of a block table, in any order."""
    if length <= 0:
        return []
    full, tail = divmod(length, block_size)
    if len(block_ids) < full + (1 if tail else 0):
        raise ValueError(f"block table of {len(block_ids)} blocks cannot hold {length} tokens")
    ranges: list[list[int]] = []
    for block in sorted(block_ids[:full]):
        if ranges and ranges[-1][1] == block * block_size:
            ranges[-1][1] += block_size
        else:
            ranges.append([block * block_size, (block + 1) * block_size])
    if tail:
        first = block_ids[full] * block_size
        for piece in ranges:
            if piece[1] == first:
                piece[1] += tail
                break
        else:
            ranges.append([first, first + tail])
    return [(start, end) for start, end in ranges]


def context_segments(block_ids: list[int], length: int, block_size: int) -> ContextSegments:
    segments = ContextSegments()
    scattered: list[tuple[int, int]] = []
    for start, end in slot_ranges(block_ids, length, block_size):
        if end - start >= MIN_VIEW_TOKENS:
            segments.views.append((start, end))
        else:
            scattered.append((start, end))
    if len(scattered) == 1:  # nothing to batch it with: a view costs no copy
        segments.views.append(scattered[0])
    elif scattered:
        slots = torch.cat([torch.arange(start, end) for start, end in scattered])
        segments.gathers.extend(slots.split(GATHER_CHUNK_TOKENS))
    return segments
