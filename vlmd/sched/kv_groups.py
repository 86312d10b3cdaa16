"""KV groups: sliding-window layers keep only the blocks their window can still see.

Layers of one attention kind share a group: the full-attention layers are the main group
(the block table every request has always had), and the layers of each sliding window
``w`` form a window group with its own block pool, its own table per request and its own
KV tensors. A query at position ``p`` of a windowed layer reads keys at ``p - w + 1 .. p``
only, so once a request's next query is at ``p``, every block wholly before ``p - w + 1``
is dead for that group: the scheduler gives it back (still findable by its prefix hash
until reused) and the table keeps a ``FREED`` placeholder there, so a block's index keeps
meaning the same tokens (docs/decisions.md D91). Torch-free: plain numbers.

Sizing: a window group's pool is sized to its worst case, so it never blocks admission nor
causes preemption; the rest of the KV budget goes to the main group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A window table's entry whose block was given back (or never adopted after a prefix hit):
# no query of the request can read it. Negative, so a read of it fails loudly.
FREED = -1


@dataclass(frozen=True)
class WindowGroup:
    """The layers of one sliding window: their pool's size in blocks."""

    window: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.window < 1 or self.num_blocks < 1:
            raise ValueError(f"a window group needs a window and blocks, got {self}")


def first_visible_block(next_position: int, window: int, block_size: int) -> int:
    """The first block a query at ``next_position`` (or any later one) can still read in a
    layer of ``window``: every block before it is dead for that layer."""
    return max(0, next_position - window + 1) // block_size


def window_blocks_held(num_tokens: int, window: int, block_size: int) -> int:
    """Blocks a window group holds for a request of ``num_tokens`` computed tokens (its next
    query at position ``num_tokens``): what a long context costs there, whatever its length."""
    return -(-num_tokens // block_size) - first_visible_block(num_tokens, window, block_size)


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most blocks a window group can ever hold at once: each running request holds the
    blocks of positions ``[start - window + 1, start + n)`` for its chunk of ``n`` tokens at
    ``start`` (``n`` = 0 when it is not scheduled this step), which is at most
    ``(n + window + 2 * block_size - 3) // block_size`` blocks (the range's two ends may each
    sit inside a block); the chunks of a step sum to at most the token budget."""
    return (max_num_batched_tokens + max_num_seqs * (window + 2 * block_size - 3)) // block_size


def separate_windows(layer_windows: Sequence[int | None], max_model_len: int) -> tuple[int, ...]:
    """The windows whose layers get a group of their own. Not a window that reaches past
    max_model_len (it never frees a block), nor any window of a model without full-attention
    layers (its windowed layers keep the main table, every block kept, as before D91)."""
    if None not in layer_windows:
        return ()
    return tuple(sorted({w for w in layer_windows if w is not None and w < max_model_len}))


def window_hit_lengths(cached: Sequence[bool], window: int, block_size: int) -> list[bool]:
    """For each prefix hit of ``k`` blocks (0 to ``len(cached)``), whether a window group can
    serve it: ``cached[i]``: block ``i`` is findable in the group's pool; a hit of ``k`` blocks
    needs blocks ``first_visible_block(k * block_size, ...) .. k - 1`` there (the window of
    the first query it leaves to compute). No hit (``k`` = 0) always serves."""
    valid = [True]
    last_missing = -1  # the last block before k that the group does not have
    for k in range(1, len(cached) + 1):
        if not cached[k - 1]:
            last_missing = k - 1
        valid.append(last_missing < first_visible_block(k * block_size, window, block_size))
    return valid
