"""The memory plan: what is left for the KV cache after weights, activations and the encoder.

    KV budget = memory x utilisation - (weights + the rest of the process) - activation peak
                - encoder cache

The activation peak is measured at start-up by a forward at the worst case the server
accepts (``vlmd/engine/profile.py``); ``vlmd cost`` uses the same arithmetic with figures it
is given. Torch-free: plain numbers in, a ``MemoryPlan`` out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
    kv_bytes_per_block: int
    block_size: int
    num_kv_blocks: int
    max_model_len: int

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_bytes_per_block

    @property
    def max_full_length_requests(self) -> int:
        """Requests of max_model_len tokens the cache holds at once."""
        return self.num_kv_blocks // -(-self.max_model_len // self.block_size)

    def fields(self) -> dict:
        """Everything, for the start-up log and /metrics."""
        return {**asdict(self), "kv_bytes": self.kv_bytes, "max_full_length_requests": self.max_full_length_requests}


def kv_budget_bytes(
    total_bytes: int, utilization: float, base_bytes: int, activation_bytes: int, encoder_cache_bytes: int
) -> int:
    """Bytes left for the KV cache; a clear error when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"a memory utilisation must be in (0, 1], got {utilization}")
    allowed = int(total_bytes * utilization)
    used = base_bytes + activation_bytes + encoder_cache_bytes
    if used >= allowed:
        raise ValueError(
            f"{utilization:.0%} of {total_bytes / GIB:.2f} GiB is {allowed / GIB:.2f} GiB, but weights and the rest "
            f"of the process take {base_bytes / GIB:.2f} GiB, activations {activation_bytes / GIB:.2f} GiB and the "
            f"encoder cache {encoder_cache_bytes / GIB:.2f} GiB: nothing is left for the KV cache; raise the "
            "utilisation, lower --max-num-batched-tokens / --encoder-cache-size, or set --kv-cache-gb"
        )
    return allowed - used


def blocks_for_bytes(budget_bytes: float, kv_bytes_per_block: int) -> int:
    return int(budget_bytes // kv_bytes_per_block)


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def check_holds_one_sequence(num_blocks: int, block_size: int, max_model_len: int, source: str) -> None:
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache ({source}) holds {num_blocks * block_size} tokens, less than max_model_len "
            f"{max_model_len}: give it more memory (--kv-cache-gb, --memory-utilization, "
            "--gpu-memory-utilization) or lower --max-model-len"
        )
