"""Picking every linear layer's kernel after the model is loaded, by measurement.

Layers of one shape share a decision (a 9-layer decoder has five distinct shapes, not 45),
and decisions are remembered for the process, so a second model of the same shapes, or a
test, does not measure again. The whole pass costs well under a second on the small LLaVA.
"""

from __future__ import annotations

import time

import torch
from torch import nn

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


def _signature(layer: LinearBase) -> tuple:
    weight = layer.weight
    return (tuple(weight.shape), weight.dtype, layer.bias is not None, torch.get_num_threads())


@torch.inference_mode()
def select_linear_kernels(model: nn.Module, mode: str = "auto") -> dict:
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
    for layer in layers:
        weight = layer.weight
        if mode == "plain" or weight.device.type != "cpu":
            layer.kernel = None
            continue
        if mode == "packed":
            choices = (PACKED if packing_available(weight) else PLAIN,) * len(M_BUCKETS)
        else:
            key = _signature(layer)
            if key not in _DECISIONS:
                choices, timings = measure_choices(weight, layer.bias, candidates_for(weight))
                _DECISIONS[key] = choices
                report["shapes"][f"{weight.shape[1]}x{weight.shape[0]}"] = {
                    "chosen": [c.name for c in choices], "ms": timings,
                }
            choices = _DECISIONS[key]
        packed = pack_weight(weight) if any(c.packed for c in choices) else None
        keep_plain = any(not c.packed for c in choices) or id(weight) in shared
        layer.kernel = SelectedKernel(choices, weight if keep_plain else None, packed)
        if not keep_plain:
            # The packed copy replaces the plain one: holding both would double the
            # weights' memory. (A weight shared with an embedding stays.)
            layer.weight = None
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


def _shared_weights(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}
