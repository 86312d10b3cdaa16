"""Cross-attention tokens: an encoder-decoder's encoder-side K/V, per request.

A request's cross-attention K/V (Whisper's audio window, Llama 3.2 Vision's images) are
computed once, from its items' encoder output, and read by every later step; they never grow
and no other request shares them. So a request's cross table (a ``CrossAttention`` group of
the KV model, ``kv_spec.py``) is taken whole when it is first scheduled, from the one pool
every group shares, held unchanged for its life and freed when it ends or is preempted (a
resumed request computes them again from the encoder output). Not prefix-cached
(docs/decisions.md D93). Blocks come as one consecutive run where the pool has one: the
runner then reads a request's K/V as a view of the cache, with no gather. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlmd.types import MultiModalItem


def cross_tokens_of(items: Sequence[MultiModalItem]) -> int:
    """Encoder tokens a request's decoder cross-attends to: those of its items without
    placeholders (an encoder-decoder's inputs), which the runner turns into cross K/V."""
    return sum(item.num_encoder_tokens for item in items if item.length == 0)


def is_consecutive(block_ids: Sequence[int]) -> bool:
    """Whether a table is one run ``first, first + 1, ...`` (read as a view, not gathered)."""
    return all(b == a + 1 for a, b in zip(block_ids, block_ids[1:]))
