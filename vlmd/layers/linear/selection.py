"""Picking every linear layer's kernel after the model is loaded, by measurement.

Layers of one shape share a decision (a 9-layer decoder has five distinct shapes, not 45),
and decisions are remembered for the process, so a second model of the same shapes, or a
test, does not measure again. Measuring stops after ``budget_s`` seconds (a loaded host
makes every timing slow): the remaining shapes take the choice most often measured per
bucket so far, or pre-packed weights where nothing was measured yet.
"""

from __future__ import annotations

import functools
import statistics
import time

import structlog
import torch
from torch import nn

from vlmd.config import LINEAR_KERNEL_MODES
from vlmd.host import last_level_cache_bytes
from vlmd.layers.linear.kernels import (
    M_BUCKETS,
    NATIVE,
    PACKED,
    PLAIN,
    KernelChoice,
    SelectedKernel,
    candidates_for,
    measure_choices,
    pack_weight,
    packing_available,
)
from vlmd.layers.cpu import fused_step
from vlmd.layers.cpu import packed_linear as native_linear
from vlmd.layers.cpu.packed_linear import PackedPanels
from vlmd.layers.cpu.panel_packing import bfloat16_panels
from vlmd.layers.decoder_structure import decoder_structures
from vlmd.layers.linear.layers import LinearBase
from vlmd.layers.linear.quantize import quantize_decoder

log = structlog.get_logger(__name__)

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
def select_linear_kernels(model: nn.Module, mode: str = "auto", budget_s: float = 2.0,
                          native_steps: bool = True, quantization: str = "none") -> dict:
    """Give every ``LinearBase`` in ``model`` its kernel; returns what was chosen and timed.

    ``mode``: ``auto`` (measure), ``plain`` (``F.linear`` everywhere), ``packed``
    (pre-packed oneDNN where available) or ``native`` (pre-packed, and vlmd's kernel for
    products of up to 32 rows wherever it reads the packed weight); the last two for tests
    and comparisons. ``native_steps``: whether the model's native decode steps can run (not
    with torch's attention), so that their products are timed as those steps run them.
    ``quantization``: "int8" quantizes the decoder's products first (``quantize.py``):
    they take vlmd's int8 kernel whatever ``mode`` says.

    A bfloat16 weight oneDNN cannot pack (an AVX2 host) gets panels vlmd builds
    (``layers/cpu/panel_packing.py``) beside its plain weight, so that vlmd's kernel, and
    with it the native decode step, can still serve its decode products.
    """
    if mode not in LINEAR_KERNEL_MODES:
        raise ValueError(f"linear kernel mode {mode!r} is not one of {', '.join(LINEAR_KERNEL_MODES)}")
    started = time.perf_counter()
    quantized = quantize_decoder(model, quantization)
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and m.weight is not None]
    shared = _shared_weights(model)
    report: dict = {"mode": mode, "shapes": {}, "quantized_layers": len(quantized)}
    measured: list[tuple[KernelChoice, ...]] = []
    streamed = _weights_outgrow_cache([layer for layer in layers if layer.weight.device.type == "cpu"])
    report["streamed"] = streamed
    # Products a native decode step would run (see choose_small_products), timed as it runs
    # them whether or not the weights fit in the cache: streamed from memory a product
    # outlasts its Python, but not by enough to leave the step out untimed (the small LLaVA
    # on an AVX2 AMD EPYC family 25 model 1, 250 MB of decoder weights: 15.1 ms a token in
    # its modules, 10.4 through the step).
    attention_runs_natively = native_steps
    native_steps = native_steps and mode == "auto" and native_linear.available()
    step_ids = _native_step_products(model) if native_steps else set()
    for layer in layers:
        weight = layer.weight
        if mode == "plain" or weight.device.type != "cpu":
            layer.kernel = None
            continue
        if mode in ("packed", "native"):
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
        # A native step's product needs the packed weight even where its own timing chose
        # F.linear: kept beside it only where the weights fit in the cache (the copy is small);
        # a streamed model's step runs only where every product chose the packed weight.
        wanted = any(c.packed for c in choices) or (id(layer) in step_ids and not streamed
                                                    and packing_available(weight))
        packed = pack_weight(weight) if wanted else None
        # Verified now, while the plain weight is here to compare against.
        panels = PackedPanels.of(weight, packed) if packed is not None and mode in ("auto", "native") else None
        storage = ()
        # Our own bfloat16 panels where oneDNN packs none (an AVX2 host) and where it packs
        # a layout the kernel does not read (AMX hosts, for the AVX-512 kernel): without
        # them a bfloat16 model's decode would leave the native step. Beside oneDNN's copy
        # (its prefill products), that holds the weight twice, as float32 holds it once.
        if panels is None and weight.dtype == torch.bfloat16 and mode in ("auto", "native") \
                and native_linear.available():
            storage, panels = bfloat16_panels(weight)
        keep_plain = any(not c.packed for c in choices) or id(weight) in shared
        layer.kernel = SelectedKernel(choices, weight if keep_plain else None, packed, panels, storage)
        if storage:  # counted with the model's bytes (engine/sizing.py: weight_bytes_of)
            layer.register_buffer("weight_panels", storage[0], persistent=False)
        if mode == "native" and panels is not None:
            layer.kernel.choices = _with_small(choices, NATIVE)
        if not keep_plain:
            # The packed copy replaces the plain one: holding both would double the
            # weights' memory. (A weight shared with an embedding stays.)
            layer.weight = None
    if mode == "auto":
        # Never less than SMALL_PRODUCTS_MIN_S: on a slow minute the per-shape timing can
        # use up the whole budget, and an untimed decode then kept oneDNN for the server's
        # life (the small LLaVA's products at M = 1: 20.2 ms against 14.0 with the kernel).
        remaining = max(budget_s - (time.perf_counter() - started), SMALL_PRODUCTS_MIN_S)
        chosen_ids = {id(layer) for layer in layers + quantized}
        selected = [m for m in model.modules() if id(m) in chosen_ids and m.kernel is not None]
        step = [layer for layer in selected if id(layer) in step_ids]
        report.update(choose_small_products(selected, budget_s=remaining, step_layers=step))
    report["seconds"] = round(time.perf_counter() - started, 3)
    _log_decode_paths(model, attention_runs_natively)
    return report


PAD_CANDIDATES = (4, 6)
PAD_MARGIN = 1.03  # padding is kept only when it beats no padding by more than this
NATIVE_MARGIN = 1.03  # vlmd's kernel is kept only when it beats oneDNN's best by more than this
SMALL_BUCKETS = tuple(range(len(M_BUCKETS) - 1))  # the buckets vlmd's kernel may take
# The least time the decode products get for their timing, whatever the per-shape timing
# left: a warm-up and a few rounds of the small LLaVA's products at M = 1 and 8 (~17 ms a
# pass on an AVX-512 AMD EPYC family 25 model 17, ~40 at M = 1 on an AVX2-only model 1).
SMALL_PRODUCTS_MIN_S = 1.5


def _with_small(choices: tuple[KernelChoice, ...], choice: KernelChoice, buckets=SMALL_BUCKETS) -> tuple:
    return tuple(choice if index in buckets else old for index, old in enumerate(choices))


def choose_small_products(layers: list[LinearBase], rounds: int = 9, clock=time.perf_counter,
                          budget_s: float = 2.0, step_layers: list[LinearBase] = (), bind=None) -> dict:
    """How a decode step's products are computed, for every layer, measured on the model's
    own products in model order: a decode step's sequence, because that is where the
    differences show (timed one shape at a time, oneDNN streams M = 1 as fast as M = 6).

    - Each small bucket, at the M it is measured at (1, then 8): oneDNN's packed kernel as
      per-shape selection left it, against vlmd's kernel on the same packed weights
      (layers whose panel layout was verified). vlmd's is kept where it beats the other by
      ``NATIVE_MARGIN``.
    - At M = 1 also: oneDNN's product of fewer rows computed on 4 or 6 rows
      (``kernels.padded_rows``), kept where it beats no padding by ``PAD_MARGIN``; it
      applies to every layer left on oneDNN.
    - ``step_layers``: the products a fused decode step of the model's decoder runs
      (``layers/cpu/fused_step.py``), every one with verified panels. That step runs them from
      C, so vlmd's kernel is also timed the way it runs them there (``bind``, default
      ``packed_linear.bound_product``: one ctypes call each, no Python around it), the
      other layers as above; where that beats the rest by ``NATIVE_MARGIN`` every layer
      with panels takes vlmd's kernel, and with it the step engages. Why: on a model small
      enough for Python to dominate (the tiny LLaVA's decoder, 64 wide) each product costs
      its module call more than its arithmetic, so timed one module call at a time
      ``F.linear`` wins and the step, which removes those calls, never runs.

    Candidates run interleaved round by round and the median of each is compared (the
    minimum of 3-5 rounds flipped between runs on a noisy host: 14.0 vs 13.0 ms is within
    its noise, medians 15.4 vs 14.1 were not). Nothing changes where not even one round
    after the warm-up fits in ``budget_s`` (a large model's pass over its weights is long).
    Returns what was chosen and the medians (ms)."""
    decided: dict = {"pad_rows": 0, "native_buckets": [], "native_step_buckets": [], "sequence_ms": {}}
    if budget_s <= 0:
        return decided
    deadline = clock() + budget_s
    native = [layer for layer in layers if layer.kernel.panels is not None]
    step_ids = {id(layer) for layer in step_layers}
    # The step runs only when every one of its products can take the kernel.
    steps = bool(step_layers) and all(layer.kernel.panels is not None for layer in step_layers)
    for index, bucket in enumerate(SMALL_BUCKETS):
        rows = M_BUCKETS[bucket][1]
        # An equal share of what is left for each bucket still to time: on a host where a
        # pass is slow (40 ms at M = 1 on an AVX2-only AMD EPYC family 25 model 1, with
        # four candidates a round) M = 1 took the whole budget and M = 8 was never timed.
        now = clock()
        bucket_deadline = now + max(deadline - now, 0.0) / (len(SMALL_BUCKETS) - index)
        baseline = {id(layer): layer.kernel.choices for layer in layers}
        padded = [layer for layer in layers if layer.kernel.packed is not None and layer.kernel.choices[bucket].packed
                  and not layer.kernel.choices[bucket].native]

        def configure(variant, bucket=bucket):
            kind, pad = variant
            for layer in layers:
                layer.kernel.pad_rows = pad
                layer.kernel.choices = baseline[id(layer)]
            if kind in ("native", "step"):
                for layer in native:
                    layer.kernel.choices = _with_small(layer.kernel.choices, NATIVE, (bucket,))

        variants = [("onednn", 0)]
        if padded and rows < max(PAD_CANDIDATES):
            variants += [("onednn", pad) for pad in PAD_CANDIDATES if pad > rows]
        if native:
            variants.append(("native", 0))
        if steps:
            variants.append(("step", 0))
        typical = _time_in_model_order(layers, rows, variants, configure, rounds, clock, bucket_deadline,
                                       step_ids, bind or native_linear.bound_product)
        decided["sequence_ms"][f"M{rows}"] = {f"{kind}" + (f"+pad{pad}" if pad else ""): round(ms * 1e3, 3)
                                               for (kind, pad), ms in typical.items() if ms != float("inf")}
        onednn = [v for v in variants if v[0] == "onednn"]
        best_pad = min(onednn, key=lambda v: typical[v])
        if typical[best_pad] * PAD_MARGIN >= typical[("onednn", 0)]:  # also when nothing was timed
            best_pad = ("onednn", 0)
        use_native = native and typical[("native", 0)] * NATIVE_MARGIN < typical[best_pad]
        use_step = steps and typical[("step", 0)] * NATIVE_MARGIN < typical[best_pad]
        configure(("native" if use_native or use_step else "onednn", 0))
        if bucket == 0:
            decided["pad_rows"] = best_pad[1]
        if use_native or use_step:
            decided["native_buckets"].append(f"M<={M_BUCKETS[bucket][0]}")
        if use_step and not use_native:
            decided["native_step_buckets"].append(f"M<={M_BUCKETS[bucket][0]}")
    for layer in layers:
        layer.kernel.pad_rows = decided["pad_rows"]
    return decided


def _time_in_model_order(layers, rows, variants, configure, rounds, clock, deadline, step_ids=frozenset(),
                         bind=None) -> dict:
    """Median seconds of one pass over every layer's product at ``rows`` rows, per variant
    (infinite where no round after the warm-up fitted before ``deadline``). In the ``step``
    variant the layers in ``step_ids`` run ``bind(x, panels)()``, as a native step would
    run them."""
    times: dict = {variant: [] for variant in variants}
    if len(variants) < 2:
        return {variant: float("inf") for variant in variants}
    inputs = [torch.randn(rows, _in_features(layer), dtype=_input_dtype(layer)) for layer in layers]
    module_calls = [functools.partial(layer.kernel, x, layer.bias) for layer, x in zip(layers, inputs)]
    calls = {variant: module_calls for variant in variants}
    if ("step", 0) in calls:
        # The step's rows are float32 whatever the weights (a bfloat16 model's are widened).
        calls[("step", 0)] = [bind(x.float(), layer.kernel.panels) if id(layer) in step_ids else call
                              for layer, x, call in zip(layers, inputs, module_calls)]
    for round_index in range(rounds + 1):  # the first round warms every candidate up
        if round_index > 1 and clock() > deadline:
            break
        for variant in variants:
            configure(variant)
            started = clock()
            for call in calls[variant]:
                call()
            elapsed = clock() - started
            if round_index:
                times[variant].append(elapsed)
        if round_index == 0 and clock() > deadline:
            break
    return {variant: statistics.median(values) if values else float("inf") for variant, values in times.items()}


def _in_features(layer: LinearBase) -> int:
    kernel = layer.kernel
    if kernel.weight is None and kernel.packed is None:  # int8 panels alone
        return kernel.panels.in_features
    return (kernel.weight if kernel.weight is not None else kernel.packed).shape[-1]


def _input_dtype(layer: LinearBase) -> torch.dtype:
    """The rows a layer's product takes: its weight's dtype (float32 for int8 weights)."""
    kernel = layer.kernel
    if kernel.weight is None and kernel.packed is None:
        return torch.float32
    return (kernel.packed if kernel.packed is not None else kernel.weight).dtype


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


def _native_step_products(model: nn.Module) -> set[int]:
    """Ids of the products that a fused decode step of the model's decoders runs
    (``layers/cpu/fused_step.py``)."""
    return {id(layer) for structure in decoder_structures(model) for layer in fused_step.products(structure)}


def _log_decode_paths(model: nn.Module, attention_runs_natively: bool) -> None:
    """One line per decoder: at which batch sizes its decode steps take one fused native
    call (every product's kernel there is vlmd's, on panels it reads), and if at none, why.
    ``vlmd_decode_steps{path}`` on /metrics then counts the steps that did."""
    for structure in decoder_structures(model):
        reason = fused_step.unsupported(structure)
        buckets = []
        for largest, rows in M_BUCKETS[:-1]:
            if fused_step.every_product_native([p.kernel for p in structure.products()], rows):
                buckets.append(f"M<={largest}")
        if reason is None and not attention_runs_natively:
            reason = "torch attention (--attention-kernels torch)"
        if reason is None and not buckets:
            reason = "no batch size has every product on vlmd's kernel (timed slower, or no panels it reads)"
        if reason is None:
            log.info("decode steps", path="fused", layers=len(structure.layers), batch_sizes=buckets)
        else:
            log.info("decode steps", path="modules", layers=len(structure.layers), reason=reason)


def _shared_weights(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}
