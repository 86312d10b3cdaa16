"""The memory plan: what is left for the KV cache after weights, activations and the encoder.

    KV budget = memory x utilisation - (weights + the rest of the process) - activation peak
                - encoder cache - the cross-attention pool

Cross-attention K/V (an encoder-decoder's, computed once per request from its items' encoder
output and held for the request's life) live in a pool of blocks of their own
(``vlmd/sched/cross_kv.py``), sized to hold ``--max-num-seqs`` requests of the items a prompt
may carry (a modality without any limit counts one item: more wait for room, docs/decisions.md
D93): ``cross_pool_blocks``. The utilisation pays for it before the KV cache gets the rest;
--kv-cache-gb and --num-kv-blocks size the self-attention cache, the cross pool beside it.

The KV cache is per KV group (``vlmd/sched/kv_groups.py``): a model with sliding-window
layers gives each window's layers a pool sized to its worst case (what the running requests'
windows and one step's tokens can hold), and the rest of the budget to the full-attention
layers' blocks, which ``num_kv_blocks`` counts (``split_kv_blocks``).

The activation peak is measured at start-up by a forward at the worst case the server
accepts (``vlmd/engine/profile.py``); ``vlmd cost`` uses the same arithmetic with figures it
is given. Torch-free: plain numbers in, a ``MemoryPlan`` out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from vlmd.sched.block_pool import blocks_needed
from vlmd.sched.kv_groups import separate_windows, window_pool_blocks
from vlmd.types import KVSpec

GIB = 2**30


@dataclass(frozen=True)
class WindowLayers:
    """The layers of one sliding window that get a KV group of their own."""

    window: int
    bytes_per_block: int  # a block in these layers
    worst_blocks: int  # the most blocks the group can ever hold (kv_groups.window_pool_blocks)


def kv_group_sizes(spec: KVSpec, dtype_bytes: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                   max_model_len: int) -> tuple[int, tuple[WindowLayers, ...]]:
    """Bytes of a main-group block (every layer without a group of its own) and each window
    group's layers; a model without windows is one group, every layer in it."""
    windows = tuple(
        WindowLayers(window, spec.layer_bytes_per_token(dtype_bytes, window) * block_size,
                     window_pool_blocks(window, block_size, max_num_seqs, max_num_batched_tokens))
        for window in separate_windows(spec.layer_windows, max_model_len)
    )
    main = spec.bytes_per_token(dtype_bytes) * block_size - sum(group.bytes_per_block for group in windows)
    return main, windows


def split_kv_blocks(budget_bytes: float, main_bytes_per_block: int,
                    windows: Sequence[WindowLayers]) -> tuple[int, tuple[int, ...]]:
    """The main group's blocks and each window group's from one byte budget: the window
    groups at their worst case, the rest main. Where that leaves the main group fewer blocks
    than a window group's worst case, every group gets the same count instead (a request
    holds a subset of its main blocks' positions in a window group)."""
    reserved = sum(group.bytes_per_block * group.worst_blocks for group in windows)
    main = int((budget_bytes - reserved) // main_bytes_per_block) if budget_bytes > reserved else 0
    if all(main >= group.worst_blocks for group in windows):
        return main, tuple(group.worst_blocks for group in windows)
    main = int(budget_bytes // (main_bytes_per_block + sum(group.bytes_per_block for group in windows)))
    return main, tuple(min(group.worst_blocks, main) for group in windows)


def window_blocks_for(main_blocks: int, windows: Sequence[WindowLayers]) -> tuple[int, ...]:
    """Each window group's blocks beside a main group of a given size (--num-kv-blocks)."""
    return tuple(min(group.worst_blocks, main_blocks) for group in windows)


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    source: str  # what sized the cache: "utilization", "kv-cache-gb" or "num-kv-blocks"
    total_bytes: int  # the memory the utilisation applies to (0 when not used)
    utilization: float  # 0 when not used
    weight_bytes: int  # parameters and buffers of the model
    base_bytes: int  # everything resident before the profile (weights included; CUDA: other users too)
    activation_bytes: int  # profile peak over the base, encoder included
    encoder_peak_bytes: int  # of which the encoder forward on the worst-case items
    encoder_cache_bytes: int  # encoder outputs kept (--encoder-cache-size tokens)
    kv_bytes_per_block: int
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    # The cross-attention pool (an encoder-decoder's, sched/cross_kv.py): its blocks and the
    # bytes of a block in every cross-attention layer (0: no cross-attention).
    cross_kv_blocks: int = 0
    cross_kv_bytes_per_block: int = 0
    max_num_seqs: int = 0  # the requests the cross pool is sized for
    # Sliding-window layers' KV groups: (window, blocks, bytes a block) each; the fields above
    # (num_kv_blocks, kv_bytes_per_block) are then the full-attention layers' group.
    window_groups: tuple[tuple[int, int, int], ...] = ()

    @property
    def window_kv_bytes(self) -> int:
        return sum(blocks * per_block for _, blocks, per_block in self.window_groups)

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_bytes_per_block + self.window_kv_bytes

    @property
    def cross_kv_bytes(self) -> int:
        return self.cross_kv_blocks * self.cross_kv_bytes_per_block

    @property
    def planned_bytes(self) -> int:
        """What the plan comes to in all: where the KV size is given (--kv-cache-gb,
        --num-kv-blocks) nothing checks it against the device, so the log says it."""
        return self.base_bytes + self.activation_bytes + self.encoder_cache_bytes + self.cross_kv_bytes + self.kv_bytes

    @property
    def max_full_length_requests(self) -> int:
        """Requests of max_model_len tokens the cache holds at once."""
        return self.num_kv_blocks // -(-self.max_model_len // self.block_size)

    def fields(self) -> dict:
        """Everything, for the start-up log and /metrics."""
        return {**asdict(self), "kv_bytes": self.kv_bytes, "window_kv_bytes": self.window_kv_bytes,
                "cross_kv_bytes": self.cross_kv_bytes,
                "planned_bytes": self.planned_bytes, "max_full_length_requests": self.max_full_length_requests}


def kv_budget_bytes(
    total_bytes: int, utilization: float, base_bytes: int, activation_bytes: int, encoder_cache_bytes: int,
    cross_kv_bytes: int = 0,
) -> int:
    """Bytes left for the KV cache; a clear error when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"a memory utilisation must be in (0, 1], got {utilization}")
    allowed = int(total_bytes * utilization)
    used = base_bytes + activation_bytes + encoder_cache_bytes + cross_kv_bytes
    if used >= allowed:
        cross = ""
        if cross_kv_bytes:
            cross = (f", the cross-attention pool {cross_kv_bytes / GIB:.2f} GiB (lower --max-num-seqs or "
                     "--limit-mm-per-prompt)")
        raise ValueError(
            f"{utilization:.0%} of {total_bytes / GIB:.2f} GiB is {allowed / GIB:.2f} GiB, but weights and the rest "
            f"of the process take {base_bytes / GIB:.2f} GiB, activations {activation_bytes / GIB:.2f} GiB, the "
            f"encoder cache {encoder_cache_bytes / GIB:.2f} GiB{cross}: nothing is left for the KV cache; raise the "
            "utilisation, lower --max-num-batched-tokens / --encoder-cache-size, or set --kv-cache-gb / --num-kv-blocks"
        )
    return allowed - used


def cross_items_per_request(supported: dict[str, int | None], flag_limits: dict[str, int]) -> dict[str, int]:
    """The items of each modality the cross pool provisions per running request: the family's
    own limit narrowed by --limit-mm-per-prompt; where neither sets one, one item (a request
    with more waits for room, and one larger than the whole pool is refused)."""
    counts = {}
    for modality, limit in supported.items():
        bounds = [value for value in (limit, flag_limits.get(modality)) if value is not None]
        counts[modality] = min(bounds) if bounds else 1
    return counts


def cross_tokens_per_request(info, counts: dict[str, int]) -> int:
    """Cross-attention tokens of ``counts`` items (0 for a family without cross-attention)."""
    return sum(info.cross_kv_tokens_per_item(modality) * count for modality, count in counts.items())


def cross_pool_blocks(tokens_per_request: int, block_size: int, max_num_seqs: int) -> int:
    """The cross pool: ``max_num_seqs`` requests of ``tokens_per_request`` cross tokens, each
    table whole blocks (0: no cross-attention)."""
    return max_num_seqs * blocks_needed(tokens_per_request, block_size)


def blocks_for_bytes(budget_bytes: float, kv_bytes_per_block: int) -> int:
    return int(budget_bytes // kv_bytes_per_block)


def check_holds_one_sequence(num_blocks: int, block_size: int, max_model_len: int, source: str) -> None:
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache ({source}) holds {num_blocks * block_size} tokens, less than max_model_len "
            f"{max_model_len}: give it more memory (--kv-cache-gb, --memory-utilization, "
            "--gpu-memory-utilization) or lower --max-model-len"
        )
