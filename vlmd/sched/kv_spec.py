"""The KV-cache model: what each layer keeps, grouped into typed layer groups over one pool.

Every layer of a model declares what it keeps per request (``LayerKind``):

- ``FullAttention``: K/V of every token (the paged cache every decoder has);
- ``SlidingWindow(w)``: K/V of the last ``w`` tokens only (blocks the window has left are
  given back as the request advances);
- ``CrossAttention``: K/V of the request's encoder tokens (an encoder-decoder's), computed
  once and held whole for the request's life;
- ``RecurrentState(bytes)``: a state of fixed size per request, whatever its length (a
  linear-attention layer's);
- ``SharedKV(layer)``: reads another layer's K/V and holds none of its own.

Layers of one kind are split into groups of ``num_slots`` layers each (the fewest layers
any kind has, as vLLM v1 does), and every group takes its blocks from **one** pool of
block ids. A block id is a page of ``num_slots`` layer slots; the ``j``-th layer of a
group keeps its K/V in slot ``j`` of its group's blocks. So every page has the same size
whatever group holds it, and a page a sliding window gives back serves any group next: the
windows' saving becomes capacity for everyone, and cross-attention or recurrent state is
paid for from the same budget (docs/decisions.md D95).

Torch-free: plain numbers, for the scheduler, the memory plan and ``vlmd cost`` alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vlmd.sched.block_pool import blocks_needed


@dataclass(frozen=True)
class FullAttention:
    name = "full_attention"


@dataclass(frozen=True)
class SlidingWindow:
    window: int
    name = "sliding_window"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {self.window}")


@dataclass(frozen=True)
class CrossAttention:
    name = "cross_attention"


@dataclass(frozen=True)
class RecurrentState:
    bytes_per_request: int  # the layer's whole state for one request (convolution and recurrent)
    name = "recurrent_state"

    def __post_init__(self) -> None:
        if self.bytes_per_request < 1:
            raise ValueError(f"a recurrent state needs a size, got {self.bytes_per_request} bytes")


@dataclass(frozen=True)
class SharedKV:
    source_layer: int  # the earlier layer whose K/V this one reads
    name = "shared_kv"


LayerKind = FullAttention | SlidingWindow | CrossAttention | RecurrentState | SharedKV
# The order groups are listed in: full attention first, so group 0 is the decoder's main table.
_KIND_ORDER = (FullAttention, SlidingWindow, CrossAttention, RecurrentState)


@dataclass(frozen=True)
class KVGroupSpec:
    """Layers of one kind whose blocks share one table per request."""

    index: int
    kind: FullAttention | SlidingWindow | CrossAttention | RecurrentState
    layers: tuple[int, ...]  # KV-model layer indices, in slot order
    # RecurrentState only: blocks one request's state takes (its bytes over a layer slot's).
    blocks_per_request: int = 0

    @property
    def window(self) -> int | None:
        return self.kind.window if isinstance(self.kind, SlidingWindow) else None

    def describe(self) -> dict:
        """For the start-up log, ``vlmd cost`` and /metrics labels."""
        row = {"group": self.index, "kind": self.kind.name, "layers": list(self.layers)}
        if self.window is not None:
            row["window"] = self.window
        return row


@dataclass(frozen=True)
class KVCacheConfig:
    """One pool of ``num_blocks`` pages and the groups that share it."""

    block_size: int
    num_blocks: int
    groups: tuple[KVGroupSpec, ...]
    num_slots: int  # layer slots in a page: the most layers any group has
    # Per KV-model layer: its group (a SharedKV layer: its source's) and its slot in that group.
    layer_group: tuple[int, ...] = ()
    layer_slot: tuple[int, ...] = ()
    # K and V of one block in one layer slot (0 where the caller sizes nothing, as in tests).
    slot_bytes: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {self.num_blocks}")
        if not self.groups:
            raise ValueError("a KV cache needs at least one group")
        if [group.index for group in self.groups] != list(range(len(self.groups))):
            raise ValueError("KV groups must be numbered 0, 1, ... in order")

    @property
    def page_bytes(self) -> int:
        """One block id: every slot's K and V."""
        return self.num_slots * self.slot_bytes

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.page_bytes

    def with_blocks(self, num_blocks: int) -> "KVCacheConfig":
        return KVCacheConfig(self.block_size, num_blocks, self.groups, self.num_slots, self.layer_group,
                             self.layer_slot, self.slot_bytes)

    def groups_of(self, kind: type) -> list[KVGroupSpec]:
        return [group for group in self.groups if isinstance(group.kind, kind)]

    # ---- what one request holds, per group (the scheduler's managers do the same live) ----

    def request_blocks(self, num_tokens: int, num_cross_tokens: int = 0) -> list[int]:
        """Blocks a request of ``num_tokens`` computed tokens holds in each group, decoding."""
        return [_held(group, num_tokens, num_cross_tokens, self.block_size) for group in self.groups]

    def peak_request_blocks(self, max_model_len: int, max_num_batched_tokens: int,
                            max_cross_tokens: int = 0) -> list[int]:
        """The most blocks one request can hold in each group at once: a window group holds a
        step's chunk beside the window before it (its earlier blocks are given back)."""
        peaks = []
        for group in self.groups:
            full = blocks_needed(max_model_len, self.block_size)
            if isinstance(group.kind, SlidingWindow):
                reach = (max_num_batched_tokens + group.kind.window + 2 * self.block_size - 3) // self.block_size
                peaks.append(min(full, reach))
            else:
                peaks.append(_held(group, max_model_len, max_cross_tokens, self.block_size))
        return peaks

    def max_concurrency(self, num_tokens: int, num_cross_tokens: int = 0) -> float:
        """Requests of ``num_tokens`` tokens the pool holds at once, decoding (vLLM's
        "maximum concurrency for N tokens per request")."""
        return self.num_blocks / max(1, sum(self.request_blocks(num_tokens, num_cross_tokens)))


def _held(group: KVGroupSpec, num_tokens: int, num_cross_tokens: int, block_size: int) -> int:
    kind = group.kind
    if isinstance(kind, FullAttention):
        return blocks_needed(num_tokens, block_size)
    if isinstance(kind, SlidingWindow):
        return window_blocks_held(num_tokens, kind.window, block_size)
    if isinstance(kind, CrossAttention):
        return blocks_needed(num_cross_tokens, block_size)
    return group.blocks_per_request


def first_visible_block(next_position: int, window: int, block_size: int) -> int:
    """The first block a query at ``next_position`` (or any later one) can still read in a
    layer of ``window``: every block before it is dead for that layer."""
    return max(0, next_position - window + 1) // block_size


def window_blocks_held(num_tokens: int, window: int, block_size: int) -> int:
    """Blocks a window group holds for a request of ``num_tokens`` computed tokens (its next
    query at position ``num_tokens``): what a long context costs there, whatever its length."""
    return blocks_needed(num_tokens, block_size) - first_visible_block(num_tokens, window, block_size)


def snapshot_positions(item_spans: Sequence[tuple[int, int]], num_prompt_tokens: int, block_size: int,
                       avoid_inside_items: bool = False) -> tuple[int, ...]:
    """Where a request's recurrent states are kept for prefix hits (D105): the last block
    boundary at or before each multimodal item's end (``item_spans``: (offset, end) of each
    item's placeholders), so another question about the same image starts after it, and the
    last boundary before the prompt's last token, so a second turn starts after the first.
    ``avoid_inside_items``: drop boundaries inside an item (a scheduler that computes every
    item in one chunk could never end a chunk there)."""
    positions = {(end // block_size) * block_size for _, end in item_spans}
    positions.add(((num_prompt_tokens - 1) // block_size) * block_size)
    if avoid_inside_items:
        positions = {p for p in positions if not any(first < p < end for first, end in item_spans)}
    return tuple(sorted(p for p in positions if 0 < p < num_prompt_tokens))


def layer_kinds(num_layers: int, layer_windows: Sequence[int | None], num_cross_layers: int,
                max_model_len: int, *, layer_state_bytes: Sequence[int | None] = (),
                layer_kv_sources: Sequence[int | None] = ()) -> tuple[LayerKind, ...]:
    """Each layer's kind from a decoder's declaration (``vlmd.types.KVSpec``): self-attention
    layers first, then cross-attention ones. A window that reaches ``max_model_len`` frees
    nothing, so its layers keep every block (full attention's group; they still mask); so do
    the windowed layers of a model without any full-attention layer (its first group is then
    the main table every step reads, as before D91). A layer with a state size keeps a
    ``RecurrentState`` instead of K/V; a layer with a K/V source is ``SharedKV`` of it,
    whatever its window (its source's group decides what is kept)."""
    windows = list(layer_windows) or [None] * num_layers
    states = list(layer_state_bytes) or [None] * num_layers
    sources = list(layer_kv_sources) or [None] * num_layers
    separate = None in windows
    kinds: list[LayerKind] = []
    for window, state, source in zip(windows, states, sources):
        if state is not None:
            kinds.append(RecurrentState(state))
        elif source is not None:
            kinds.append(SharedKV(source))
        elif window is not None and separate and window < max_model_len:
            kinds.append(SlidingWindow(window))
        else:
            kinds.append(FullAttention())
    return tuple(kinds) + (CrossAttention(),) * num_cross_layers


def build_kv_cache_config(kinds: Sequence[LayerKind], block_size: int, num_blocks: int,
                          slot_bytes: int = 0) -> KVCacheConfig:
    """Group the layers: each kind's layers, in order, into groups of ``num_slots`` (the
    fewest layers of any kind; a kind's last group may have fewer, its pages' other slots
    unused). A ``SharedKV`` layer joins its source's group and slot and holds nothing."""
    owners: dict[LayerKind, list[int]] = {}
    for layer, kind in enumerate(kinds):
        if isinstance(kind, SharedKV):
            source = kind.source_layer
            if not 0 <= source < layer or isinstance(kinds[source], (SharedKV, RecurrentState)):
                raise ValueError(f"layer {layer} shares the K/V of layer {source}, which is not an earlier "
                                 "attention layer with K/V of its own")
            continue
        owners.setdefault(kind, []).append(layer)
    if not owners:
        raise ValueError("a KV cache needs at least one layer that keeps something")
    num_slots = min(len(layers) for layers in owners.values())
    ordered = sorted(owners.items(), key=lambda item: (
        _KIND_ORDER.index(type(item[0])), item[0].window if isinstance(item[0], SlidingWindow) else 0))
    groups: list[KVGroupSpec] = []
    group_of = [0] * len(kinds)
    slot_of = [0] * len(kinds)
    for kind, layers in ordered:
        for first in range(0, len(layers), num_slots):
            members = tuple(layers[first:first + num_slots])
            per_request = 0
            if isinstance(kind, RecurrentState):
                if slot_bytes < 1:
                    raise ValueError("a recurrent state is sized in pages: the layer slot's bytes are needed")
                per_request = -(-kind.bytes_per_request // slot_bytes)
            for slot, layer in enumerate(members):
                group_of[layer], slot_of[layer] = len(groups), slot
            groups.append(KVGroupSpec(len(groups), kind, members, per_request))
    for layer, kind in enumerate(kinds):
        if isinstance(kind, SharedKV):
            group_of[layer], slot_of[layer] = group_of[kind.source_layer], slot_of[kind.source_layer]
    return KVCacheConfig(block_size, num_blocks, tuple(groups), num_slots, tuple(group_of), tuple(slot_of),
                         slot_bytes)
