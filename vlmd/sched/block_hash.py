"""Chained block hashes for the prefix cache.

hash(block i) = blake3(hash(block i-1), the block's token ids, extra keys), where the
extra keys name every media item touching the block by (identifier, item offset relative
to the block start). Placeholder tokens are identical for every image, so without the
extra keys two different images of the same size would share KV blocks.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from blake3 import blake3

from vlmd.types import MultiModalItem

NONE_HASH = b"\x00" * 32


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    hasher = blake3(parent)
    hasher.update(array("q", token_ids).tobytes())
    for identifier, relative_offset in extra_keys:
        hasher.update(f"|mm:{identifier}:{relative_offset}".encode())
    return hasher.digest()


def block_extra_keys(items: Sequence[MultiModalItem], block_start: int, block_end: int) -> tuple:
    """(identifier, offset relative to the block) of each item overlapping the block; an item
    without placeholders (an encoder-decoder's input) counts in the block holding its offset,
    so the chain of every later block names it too."""
    return tuple(
        (item.identifier, item.offset - block_start)
        for item in items
        if item.offset < block_end and item.use_end > block_start
    )


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], items: Sequence[MultiModalItem], block_size: int
) -> None:
    """Append hashes for every full block of ``token_ids`` not hashed yet."""
    for index in range(len(hashes), len(token_ids) // block_size):
        start = index * block_size
        end = start + block_size
        parent = hashes[-1] if hashes else NONE_HASH
        hashes.append(hash_block(parent, token_ids[start:end], block_extra_keys(items, start, end)))
