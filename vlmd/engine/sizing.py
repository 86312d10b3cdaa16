"""Start-up decisions that size the engine: which items can ever fit, which encoders are
needed, and how many KV blocks the memory plan gives (``memory_plan.py`` has the arithmetic).
"""

from __future__ import annotations

import structlog
import torch

from vlmd.config import DEFAULT_CPU_KV_CACHE_GB, ServeConfig
from vlmd.engine.memory_plan import (
    GIB,
    MemoryPlan,
    WindowLayers,
    check_holds_one_sequence,
    kv_budget_bytes,
    split_kv_blocks,
    window_blocks_for,
)
from vlmd.engine.profile import ProfileResult
from vlmd.runner.device import DeviceMemory

log = structlog.get_logger(__name__)


def check_items_fit(largest: dict, max_model_len: int, config: ServeConfig) -> None:
    """The largest item of each enabled modality must fit one prompt and the encoder limits
    set explicitly; else the server could accept requests it can never schedule."""
    for modality, processed in largest.items():
        tokens = len(processed.replacement)
        if tokens + 1 >= max_model_len:
            raise ValueError(
                f"the largest {modality} this server accepts takes {tokens} prompt tokens, which cannot fit "
                f"max_model_len {max_model_len} with any text: raise --max-model-len, shrink the item "
                f"(max_pixels in --mm-processor-kwargs, num_frames in --media-io-kwargs) or set "
                f"--limit-mm-per-prompt {modality}=0"
            )
        encoder_tokens = processed.num_encoder_tokens
        encoder_tokens = tokens - processed.placeholder_offset if encoder_tokens is None else encoder_tokens
        for flag, value in (("--max-num-encoder-input-tokens", config.max_num_encoder_input_tokens),
                            ("--encoder-cache-size", config.encoder_cache_size)):
            if value is not None and encoder_tokens > value:
                raise ValueError(
                    f"the largest {modality} this server accepts needs {encoder_tokens} encoder tokens, more than "
                    f"{flag} {value}: raise {flag}, shrink the item (--mm-processor-kwargs, --media-io-kwargs) "
                    f"or set --limit-mm-per-prompt {modality}=0"
                )


def drop_unused_encoders(model, supported: dict, modalities: list[str]) -> list[str]:
    """Encoders of modalities limited to 0 are freed before the model moves to the device.

    A family's model may implement ``drop_encoders(modalities) -> list[str]`` (the
    modules it dropped); one without it keeps its encoders.
    """
    disabled = [m for m in supported if m not in modalities]
    if not disabled:
        return []
    # An encoder-decoder whose decoder cross-attends per request to all its items
    # (``prepare_request_cross_attention``, Llama 3.2 Vision) runs a request without any
    # as text only; one with a single encoder input (Whisper) needs it in every request.
    if not modalities and getattr(model, "is_encoder_decoder", False) \
            and getattr(model, "prepare_request_cross_attention", None) is None:
        raise ValueError(f"--limit-mm-per-prompt disables {disabled}, but this encoder-decoder model needs "
                         "its encoder for every request")
    drop = getattr(model, "drop_encoders", None)
    return list(drop(set(disabled))) if drop is not None else []


def weight_bytes_of(model: torch.nn.Module) -> int:
    """Parameters, buffers and the pre-packed weights of linear kernels (which replace
    their layer's plain weight, so ``parameters()`` alone misses most of a packed model)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    for module in model.modules():
        packed = getattr(getattr(module, "kernel", None), "packed", None)
        if isinstance(packed, torch.Tensor):
            tensors[id(packed)] = packed
    return sum(t.numel() * t.element_size() for t in tensors.values())


def plan_kv_cache(
    config: ServeConfig, device: torch.device, profile: ProfileResult, weight_bytes: int, kv_bytes_per_block: int,
    encoder_cache_bytes: int, max_model_len: int, cross: tuple[int, int] = (0, 0),
    windows: tuple[WindowLayers, ...] = (),
) -> MemoryPlan:
    """KV blocks from, in order: --num-kv-blocks, --kv-cache-gb, the utilisation of the
    device's memory (CUDA: --gpu-memory-utilization; CPU: --memory-utilization), else 4 GiB.
    ``cross``: the cross-attention pool's (blocks, bytes a block), which the utilisation pays
    for first (memory_plan.cross_pool_blocks; the other sources size the self-attention cache).
    ``kv_bytes_per_block``: a block of the main group; ``windows``: the sliding-window layers
    with groups of their own, which a byte budget pays for first (--num-kv-blocks counts
    the main group's blocks: memory_plan.split_kv_blocks)."""
    memory = DeviceMemory(device)
    total, utilization, base = 0, 0.0, profile.base_bytes
    if config.num_kv_blocks is not None:
        source, blocks = "num-kv-blocks", config.num_kv_blocks
        window_blocks = window_blocks_for(blocks, windows)
    elif config.kv_cache_gb is not None:
        source = "kv-cache-gb"
        blocks, window_blocks = split_kv_blocks(config.kv_cache_gb * GIB, kv_bytes_per_block, windows)
    elif device.type == "cuda" or config.memory_utilization is not None:
        source = "utilization"
        total = memory.total_bytes()
        if device.type == "cuda":
            utilization = config.gpu_memory_utilization
            # What torch does not account for (the CUDA context, other processes) counts too.
            base += max(0, memory.used_bytes() - torch.cuda.memory_reserved(device))
        else:
            utilization = config.memory_utilization
            # The processed-media cache shares the host's memory with the KV cache.
            base += int(config.mm_processor_cache_gb * GIB)
        budget = kv_budget_bytes(total, utilization, base, profile.activation_bytes, encoder_cache_bytes,
                                 cross[0] * cross[1])
        blocks, window_blocks = split_kv_blocks(budget, kv_bytes_per_block, windows)
    else:
        source = "kv-cache-gb"
        blocks, window_blocks = split_kv_blocks(DEFAULT_CPU_KV_CACHE_GB * GIB, kv_bytes_per_block, windows)
    check_holds_one_sequence(blocks, config.block_size, max_model_len, source)
    return MemoryPlan(
        device=str(device), source=source, total_bytes=total, utilization=utilization, weight_bytes=weight_bytes,
        base_bytes=base, activation_bytes=profile.activation_bytes, encoder_peak_bytes=profile.encoder_peak_bytes,
        encoder_cache_bytes=encoder_cache_bytes, cross_kv_blocks=cross[0], cross_kv_bytes_per_block=cross[1],
        max_num_seqs=config.max_num_seqs, kv_bytes_per_block=kv_bytes_per_block,
        block_size=config.block_size, num_kv_blocks=blocks, max_model_len=max_model_len,
        window_groups=tuple((group.window, count, group.bytes_per_block) for group, count in zip(windows, window_blocks)),
    )
