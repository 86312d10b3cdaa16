"""Start-up decisions that size the engine: which items can ever fit, which encoders are
needed, and how many KV blocks the memory plan gives (``memory_plan.py`` has the arithmetic).
"""

from __future__ import annotations

import structlog
import torch

from vlmd.config import DEFAULT_CPU_KV_CACHE_GB, ServeConfig
from vlmd.engine.memory_plan import GIB, MemoryPlan, blocks_for_bytes, check_holds_one_sequence, kv_budget_bytes
from vlmd.engine.profile import ProfileResult
from vlmd.runner.device import DeviceMemory
from vlmd.sched.kv_spec import KVCacheConfig

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


def drop_unused_encoders(model, supported: dict, modalities: list[str], accepts_text_only_prompts: bool) -> list[str]:
    """Encoders of modalities limited to 0 are freed before the model moves to the device,
    by the model's ``drop_encoders`` where it declares one (``ModelCapabilities``); one
    without it keeps its encoders. ``accepts_text_only_prompts``: the processing info's
    word on whether a prompt may come without items (Whisper's may not, so its encoder
    cannot be disabled)."""
    disabled = [m for m in supported if m not in modalities]
    if not disabled:
        return []
    if not modalities and not accepts_text_only_prompts:
        raise ValueError(f"--limit-mm-per-prompt disables {disabled}, but this model needs an item "
                         "(its encoder) in every request")
    return list(model.drop_encoders(set(disabled))) if model.capabilities.drop_encoders else []


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
    config: ServeConfig, device: torch.device, profile: ProfileResult, weight_bytes: int, kv_cache: KVCacheConfig,
    encoder_cache_bytes: int, max_model_len: int, max_cross_tokens: int = 0,
) -> MemoryPlan:
    """The pool's pages from, in order: --num-kv-blocks, --kv-cache-gb, the utilisation of
    the device's memory (CUDA: --gpu-memory-utilization; CPU: --memory-utilization), else
    4 GiB. ``kv_cache``: the KV model's groups and page size (its block count is set here);
    every group (cross-attention included) takes its blocks from that one budget (D95).
    ``max_cross_tokens``: the most cross-attention tokens a request may bring, for the plan's
    full-length figures."""
    memory = DeviceMemory(device)
    total, utilization, base = 0, 0.0, profile.base_bytes
    page = kv_cache.page_bytes
    if config.num_kv_blocks is not None:
        source, blocks = "num-kv-blocks", config.num_kv_blocks
    elif config.kv_cache_gb is not None:
        source, blocks = "kv-cache-gb", blocks_for_bytes(config.kv_cache_gb * GIB, page)
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
        budget = kv_budget_bytes(total, utilization, base, profile.activation_bytes, encoder_cache_bytes)
        blocks = blocks_for_bytes(budget, page)
    else:
        source, blocks = "kv-cache-gb", blocks_for_bytes(DEFAULT_CPU_KV_CACHE_GB * GIB, page)
    sized = kv_cache.with_blocks(max(blocks, 1))
    check_holds_one_sequence(sized if blocks >= 1 else kv_cache.with_blocks(1), max_model_len,
                             config.max_num_batched_tokens, source)
    return MemoryPlan(
        device=str(device), source=source, total_bytes=total, utilization=utilization, weight_bytes=weight_bytes,
        base_bytes=base, activation_bytes=profile.activation_bytes, encoder_peak_bytes=profile.encoder_peak_bytes,
        encoder_cache_bytes=encoder_cache_bytes, kv_cache=sized, max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens, max_cross_tokens=max_cross_tokens,
    )
