"""The start-up profile: one pass at the worst case the server accepts, and its peak memory.

Worst case per step: the token budget (``--max-num-batched-tokens``) of prefill together
with the encoder on as many of a modality's largest items (the family's dummy inputs under
the server-wide ``--mm-processor-kwargs`` / ``--media-io-kwargs``) as the encoder budget
takes. Each enabled modality is profiled in its own run, through the real scheduler and
runner (so chunking, encoder batching and attention are the serving code paths), on a
scratch KV cache just large enough; the encoder alone is also measured, for the plan.

The scratch cache is allocated and touched before the baseline is read, so the figure is
activations only (CUDA: allocator bytes; CPU: resident set, see ``runner/device.py``).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass

import torch

from vlmd.engine.core import EngineCore
from vlmd.runner.device import DeviceMemory
from vlmd.runner.model_runner import ModelRunner
from vlmd.sched.cross_kv import cross_tokens_of
from vlmd.sched.scheduler import Scheduler, SchedulerConfig
from vlmd.types import EngineRequest, MultiModalItem, SamplingParams


@dataclass(frozen=True)
class ProfileResult:
    base_bytes: int  # resident before the profile (CPU: the process; CUDA: allocated), scratch cache excluded
    activation_bytes: int  # peak over the base, encoder included
    encoder_peak_bytes: int  # the encoder alone on the worst-case items
    method: str
    seconds: float


def unprofiled() -> ProfileResult:
    """No profile run (tensor parallelism: a forward needs every rank); the plan then rests
    on --kv-cache-gb / --num-kv-blocks, or on the utilisation without activation figures."""
    return ProfileResult(base_bytes=0, activation_bytes=0, encoder_peak_bytes=0, method="not profiled", seconds=0.0)


@dataclass
class ProfileRun:
    name: str
    requests: list[EngineRequest]


def worst_case_runs(
    processor, dummy, modalities: list[str], config: SchedulerConfig, filler_token: int, cross_attends: bool
) -> list[ProfileRun]:
    """One run per enabled modality (text only when none is): item requests + budget filler.
    ``cross_attends`` (``ModelCapabilities.cross_attends``): the item requests fill the budget
    themselves, since a text-only filler's rows skip cross-attention (and Whisper accepts no text-only prompt)."""
    budget, longest = config.max_num_batched_tokens, config.max_model_len - 1
    runs = []
    for modality in modalities:
        info = processor.info
        output = processor.apply([info.marker_token_id(modality), filler_token], {modality: [dummy.dummy_item(modality)]})
        (item,) = output.items
        # As many of the largest item as one step's encoder budget (and the batch) takes.
        count = max(1, min(config.max_num_encoder_input_tokens // max(item.num_encoder_tokens, 1), config.max_num_seqs - 1))
        requests = []
        for index in range(count):
            prompt = list(output.prompt_token_ids)
            if cross_attends:  # every budget token cross-attends: fill each item request instead
                prompt += [filler_token] * max(0, min(longest, budget // count) - len(prompt))
            unique = dataclasses.replace(item, identifier=f"{item.identifier}-profile-{index}")
            requests.append(_request(f"profile-{modality}-{index}", prompt, [unique], output))
        if not cross_attends:
            requests += _filler(budget, longest, filler_token, f"profile-{modality}-text")
        runs.append(ProfileRun(modality, requests))
    if not modalities:  # text only (a model that needs an item in every prompt is refused before this)
        runs.append(ProfileRun("text", _filler(budget, longest, filler_token, "profile-text")))
    return runs


def _request(request_id: str, prompt: list[int], items: list[MultiModalItem], output) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True), items,
                         family_state=output.family_state)


def _filler(tokens: int, longest: int, filler_token: int, prefix: str) -> list[EngineRequest]:
    requests, index = [], 0
    while tokens > 0:
        length = min(tokens, longest)
        requests.append(EngineRequest(f"{prefix}-{index}", [filler_token] * length, SamplingParams(max_tokens=1, ignore_eos=True)))
        tokens -= length
        index += 1
    return requests


@torch.inference_mode()
def profile_peak(model, runs: list[ProfileRun], config: SchedulerConfig, dtype: torch.dtype,
                 device: torch.device, attention_kernels: str = "auto") -> ProfileResult:
    started = time.perf_counter()
    kv = config.kv_cache
    # Every request of the largest run at once, each at its most in every group (its
    # cross-attention table included, an encoder-decoder's).
    needed = max((sum(sum(kv.peak_request_blocks(len(r.prompt_token_ids) + 1, len(r.prompt_token_ids) + 1,
                                                  cross_tokens_of(r.mm_items)))
                      for r in run.requests) for run in runs), default=1)
    scratch = dataclasses.replace(config, kv_cache=kv.with_blocks(max(needed, config.num_kv_blocks)),
                                  enable_prefix_caching=False)
    runner = ModelRunner(model, scratch.kv_cache, dtype, device=device, attention_kernels=attention_kernels)
    for k_cache, v_cache in runner.kv_slots:  # resident now, so the baseline holds it
        k_cache.zero_()
        v_cache.zero_()
    scratch_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_slots)
    memory = DeviceMemory(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = memory.current_bytes()

    encoder_peak = 0
    for run in runs:
        items = [item for request in run.requests for item in request.mm_items]
        if items:
            memory.reset_peak()
            model.embed_multimodal(items[0].modality, [item.encoder_inputs for item in items])
            encoder_peak = max(encoder_peak, memory.peak_bytes() - base)
    peak = encoder_peak
    for run in runs:
        core = EngineCore(Scheduler(scratch), runner)
        memory.reset_peak()
        for request in run.requests:
            core.add_request(request)
        while core.has_work():
            core.step()
        peak = max(peak, memory.peak_bytes() - base)
        runner.encoder_outputs.clear()
        runner.requests.clear()
    del runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ProfileResult(base - scratch_bytes, max(peak, 0), max(encoder_peak, 0), memory.method,
                         time.perf_counter() - started)
