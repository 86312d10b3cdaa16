"""Picking every linear layer's kernel after the model is loaded, by measurement.

Layers of one shape share a decision (a 9-layer decoder has five distinct shapes, not 45),
and decisions are remembered for the process, so a second model of the same shapes, or a
test, does not measure again. Measuring stops after ``budget_s`` seconds (a loaded host
makes every timing slow): the remaining shapes take the choice most often measured per
bucket so far, or pre-packed weights where nothing was measured yet.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from vlmd.host import last_level_cache_bytes
from vlmd.layers.linear.kernels import (
    M_BUCKETS,
    PACKED,
    PLAIN,
    KernelChoice,
    SelectedKernel,
    candidates_for,
    measure_choices,
    pack_weight,
    packing_available,
)
from vlmd.layers.linear.layers import LinearBase

_DECISIONS: dict[tuple, tuple[KernelChoice, ...]] = {}


def _signature(layer: LinearBase, streamed: bool) -> tuple:
    weight = layer.weight
    return (tuple(weight.shape), weight.dtype, layer.bias is not None, torch.get_num_threads(), streamed)


def _weights_outgrow_cache(layers: list[LinearBase]) -> bool:
    """Whether these layers' weights together exceed the last-level cache (a decode step
    then streams them from memory: see ``kernels.measure_choices``)."""
    total = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    return total > last_level_cache_bytes()


@torch.inference_mode()
def select_linear_kernels(model: nn.Module, mode: str = "auto", budget_s: float = 2.0) -> dict:
    """Give every ``LinearBase`` in ``model`` its kernel; returns what was chosen and timed.

    ``mode``: ``auto`` (measure), ``plain`` (``F.linear`` everywhere) or ``packed``
    (pre-packed oneDNN where available; for tests and comparisons).
    """
    if mode not in ("auto", "plain", "packed"):
        raise ValueError(f"linear kernel mode {mode!r} is not one of auto, plain, packed")
    started = time.perf_counter()
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and m.weight is not None]
    shared = _shared_weights(model)
    report: dict = {"mode": mode, "shapes": {}}
    measured: list[tuple[KernelChoice, ...]] = []
    streamed = _weights_outgrow_cache([layer for layer in layers if layer.weight.device.type == "cpu"])
    report["streamed"] = streamed
    for layer in layers:
        weight = layer.weight
        if mode == "plain" or weight.device.type != "cpu":
            layer.kernel = None
            continue
        if mode == "packed":
            choices = (PACKED if packing_available(weight) else PLAIN,) * len(M_BUCKETS)
        else:
            key = _signature(layer, streamed)
            name = f"{weight.shape[1]}x{weight.shape[0]}"
            if key not in _DECISIONS:
                if time.perf_counter() - started < budget_s:
                    choices, timings = measure_choices(weight, layer.bias, candidates_for(weight), streamed=streamed)
                    report["shapes"][name] = {"chosen": [c.name for c in choices], "ms": timings}
                    measured.append(choices)
                    _DECISIONS[key] = choices
                else:
                    choices = _unmeasured_default(measured, weight)
                    report["shapes"][name] = {"chosen": [c.name for c in choices], "ms": None}
            else:
                choices = _DECISIONS[key]
        packed = pack_weight(weight) if any(c.packed for c in choices) else None
        keep_plain = any(not c.packed for c in choices) or id(weight) in shared
        layer.kernel = SelectedKernel(choices, weight if keep_plain else None, packed)
        if not keep_plain:
            # The packed copy replaces the plain one: holding both would double the
            # weights' memory. (A weight shared with an embedding stays.)
            layer.weight = None
    if mode == "auto":
        remaining = budget_s - (time.perf_counter() - started)
        report["pad_rows"] = choose_padding([layer for layer in layers if layer.kernel is not None], budget_s=remaining)
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


PAD_CANDIDATES = (4, 6)
PAD_MARGIN = 1.03  # padding is kept only when it beats no padding by more than this


def choose_padding(layers: list[LinearBase], rounds: int = 9, clock=time.perf_counter, budget_s: float = 2.0) -> int:
    """How many rows a packed product of fewer rows is computed on (``kernels.padded_rows``),
    for every layer: measured on the model's own products in model order at M = 1, a decode
    step's sequence, because that is where the effect shows (timed one shape at a time,
    M = 1 streams as fast as M = 6). Candidates run interleaved round by round and the
    median of each is compared (the minimum of 3-5 rounds flipped between runs on a noisy
    host: 14.0 vs 13.0 ms is within its noise, medians 15.4 vs 14.1 were not); 0 (no
    padding) unless a candidate beats it by ``PAD_MARGIN``, or when not even one round
    after the warm-up fits in ``budget_s`` (a large model's pass over its weights is long).
    Set on every kernel."""
    sequence = [layer for layer in layers if layer.kernel.packed is not None and layer.kernel.choices[0].packed]
    if not sequence or budget_s <= 0:
        return 0
    deadline = clock() + budget_s
    inputs = [torch.randn(1, layer.kernel.packed.shape[-1], dtype=layer.kernel.packed.dtype) for layer in sequence]
    times: dict[int, list[float]] = {pad: [] for pad in (0, *PAD_CANDIDATES)}
    for round_index in range(rounds + 1):  # the first round warms every candidate up
        if round_index > 1 and clock() > deadline:
            break
        for pad in times:
            for layer in sequence:
                layer.kernel.pad_rows = pad
            started = clock()
            for layer, x in zip(sequence, inputs):
                layer.kernel(x, layer.bias)
            elapsed = clock() - started
            if round_index:
                times[pad].append(elapsed)
        if round_index == 0 and clock() > deadline:
            break
    typical = {pad: statistics.median(values) if values else float("inf") for pad, values in times.items()}
    chosen = min(PAD_CANDIDATES, key=lambda pad: typical[pad])
    if typical[chosen] * PAD_MARGIN >= typical[0]:  # also when nothing was timed (all infinite)
        chosen = 0
    for layer in layers:
        layer.kernel.pad_rows = chosen
    return chosen


def _unmeasured_default(measured: list[tuple[KernelChoice, ...]], weight: torch.Tensor) -> tuple[KernelChoice, ...]:
    fallback = PACKED if packing_available(weight) else PLAIN
    if not measured:
        return (fallback,) * len(M_BUCKETS)
    chosen = []
    for bucket in range(len(M_BUCKETS)):
        votes = [choices[bucket] for choices in measured]
        pick = max(set(votes), key=votes.count)
        chosen.append(pick if (not pick.packed or fallback.packed) else PLAIN)
    return tuple(chosen)


def _shared_weights(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}
