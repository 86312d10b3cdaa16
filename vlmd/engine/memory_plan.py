"""The memory plan: what is left for the KV cache after weights, activations and the encoder.

    KV budget = memory x utilisation - (weights + the rest of the process) - activation peak
                - encoder cache

The KV cache is one pool of pages that every KV group shares (``vlmd/sched/kv_spec.py``):
full-attention layers, sliding windows, cross-attention (an encoder-decoder's encoder-side
K/V) and recurrent state alike take their blocks from it, so --kv-cache-gb, --num-kv-blocks
and the utilisation bound all of them, with no group reserved for its worst case
(docs/decisions.md D95). A page is ``num_slots`` layer slots of one block each.

The activation peak is measured at start-up by a forward at the worst case the server
accepts (``vlmd/engine/profile.py``); ``vlmd cost`` uses the same arithmetic with figures it
is given. Torch-free: plain numbers in, a ``MemoryPlan`` out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vlmd.sched.kv_spec import KVCacheConfig

GIB = 2**30


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
    kv_cache: KVCacheConfig  # the pool and its groups
    max_model_len: int
    max_num_batched_tokens: int = 0  # bounds what a window group holds for one request's chunk
    max_cross_tokens: int = 0  # the most cross-attention tokens one request may bring

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_cache.page_bytes

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def kv_bytes(self) -> int:
        return self.kv_cache.bytes

    @property
    def planned_bytes(self) -> int:
        """What the plan comes to in all: where the KV size is given (--kv-cache-gb,
        --num-kv-blocks) nothing checks it against the device, so the log says it."""
        return self.base_bytes + self.activation_bytes + self.encoder_cache_bytes + self.kv_bytes

    @property
    def max_full_length_requests(self) -> int:
        """Requests of max_model_len tokens the cache holds at once, decoding (every group's
        blocks counted; a request with cross-attention items at its most)."""
        return int(self.kv_cache.max_concurrency(self.max_model_len, self.max_cross_tokens))

    def group_rows(self) -> list[dict]:
        """Per KV group: its kind and layers, and the blocks a request of max_model_len tokens
        holds there, decoding and at its most."""
        held = self.kv_cache.request_blocks(self.max_model_len, self.max_cross_tokens)
        peak = self.kv_cache.peak_request_blocks(self.max_model_len, self.max_num_batched_tokens,
                                                 self.max_cross_tokens)
        return [{**group.describe(), "full_length_request_blocks": blocks, "peak_request_blocks": most}
                for group, blocks, most in zip(self.kv_cache.groups, held, peak)]

    def fields(self) -> dict:
        """Everything, for the start-up log and /metrics."""
        plain = {key: value for key, value in asdict(self).items() if key != "kv_cache"}
        return {**plain, "num_kv_blocks": self.num_kv_blocks, "kv_bytes_per_block": self.kv_bytes_per_block,
                "block_size": self.block_size, "kv_layer_slots": self.kv_cache.num_slots,
                "kv_groups": self.group_rows(), "kv_bytes": self.kv_bytes, "planned_bytes": self.planned_bytes,
                "max_full_length_requests": self.max_full_length_requests,
                "max_concurrency": round(self.kv_cache.max_concurrency(self.max_model_len, self.max_cross_tokens), 2)}


def kv_budget_bytes(
    total_bytes: int, utilization: float, base_bytes: int, activation_bytes: int, encoder_cache_bytes: int,
) -> int:
    """Bytes left for the KV cache; a clear error when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"a memory utilisation must be in (0, 1], got {utilization}")
    allowed = int(total_bytes * utilization)
    used = base_bytes + activation_bytes + encoder_cache_bytes
    if used >= allowed:
        raise ValueError(
            f"{utilization:.0%} of {total_bytes / GIB:.2f} GiB is {allowed / GIB:.2f} GiB, but weights and the rest "
            f"of the process take {base_bytes / GIB:.2f} GiB, activations {activation_bytes / GIB:.2f} GiB, the "
            f"encoder cache {encoder_cache_bytes / GIB:.2f} GiB: nothing is left for the KV cache; raise the "
            "utilisation, lower --max-num-batched-tokens / --encoder-cache-size, or set --kv-cache-gb / --num-kv-blocks"
        )
    return allowed - used


def cross_items_per_request(supported: dict[str, int | None], flag_limits: dict[str, int]) -> dict[str, int]:
    """The items of each modality one request may bring for cross-attention: the family's own
    limit narrowed by --limit-mm-per-prompt; where neither sets one, one item (what the
    plan's and ``vlmd cost``'s full-length figures assume; a request with more is served if
    the pool has room)."""
    counts = {}
    for modality, limit in supported.items():
        bounds = [value for value in (limit, flag_limits.get(modality)) if value is not None]
        counts[modality] = min(bounds) if bounds else 1
    return counts


def cross_tokens_per_request(info, counts: dict[str, int]) -> int:
    """Cross-attention tokens of ``counts`` items (0 for a family without cross-attention)."""
    return sum(info.cross_kv_tokens_per_item(modality) * count for modality, count in counts.items())


def blocks_for_bytes(budget_bytes: float, kv_bytes_per_block: int) -> int:
    return int(budget_bytes // kv_bytes_per_block)


def check_holds_one_sequence(config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int,
                             source: str) -> None:
    """One request of max_model_len tokens must fit the pool alone, at its most."""
    needed = sum(config.peak_request_blocks(max_model_len, max_num_batched_tokens))
    if config.num_blocks < needed:
        raise ValueError(
            f"the KV cache ({source}) has {config.num_blocks} blocks of {config.block_size} tokens, but one request "
            f"of max_model_len {max_model_len} tokens needs {needed} across its KV groups: give it more memory "
            "(--kv-cache-gb, --memory-utilization, --gpu-memory-utilization) or lower --max-model-len"
        )
