"""Choosing, by measurement on this host, how each linear layer multiplies.

Candidates for a product ``x @ W.T + b`` on CPU:
- ``plain``: ``F.linear`` on the checkpoint-layout weight;
- ``packed``: the weight reordered once into oneDNN's blocked layout
  (``mkldnn._reorder_linear_weight``) and multiplied by ``mkldnn._linear_pointwise``. At
  small M (decode) the plain path re-packs W on every call and streams it at a fraction of
  memory bandwidth; pre-packed weights skip that;
- ``native``: the same packed weight read by vlmd's own kernel
  (``vlmd/layers/cpu/packed_linear.c``), for the small buckets (a decode step's 1-32
  rows), where it streams the weights closer to memory bandwidth than oneDNN does. Only
  offered where the packed layout was verified on the layer's own weight (float32, or
  bfloat16 in oneDNN's K-paired layout), or where vlmd built the panels itself
  (``layers/cpu/panel_packing.py``: bfloat16 where oneDNN cannot pack it, and the
  weight-only int8 of ``--quantization int8``);
- ``dequantized`` (int8 panels only): the float32 weight rebuilt for the call and
  ``F.linear`` on it, for the many-row products of a prefill chunk;
- each at the process's intra-op thread count, or at one thread (at small M the fork/join
  of a second thread can cost more than it saves).

The best one depends on the shape, the batch size M and the host, so it is measured at load
time, per distinct (in, out, dtype, bias) shape and per M bucket, on the layer's own weight.
Every candidate computes the same product: results agree with ``F.linear`` to float
rounding (oneDNN sums in a different order), which tests/test_linear.py bounds.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlmd.layers.cpu.packed_linear import PackedPanels
from vlmd.layers.cpu.packed_linear import packed_linear as native_packed_linear
from vlmd.layers.cpu.panel_packing import dequantized

# (largest M of the bucket, M the bucket is measured at); the last bucket is open-ended.
M_BUCKETS: tuple[tuple[int, int], ...] = ((4, 1), (32, 8), (1 << 62, 64))
# Keeping the plain weight beside a packed one doubles the layer's memory: plain is only
# chosen for a bucket when it beats the best packed kernel by more than this factor.
PLAIN_MARGIN = 1.15


@dataclass(frozen=True)
class KernelChoice:
    packed: bool
    threads: int | None  # None: leave the process's intra-op thread count as it is
    native: bool = False  # the packed weight read by vlmd's kernel rather than oneDNN's
    dequantized: bool = False  # int8 panels turned back into a float32 weight for F.linear

    @property
    def name(self) -> str:
        kind = "native" if self.native else "packed" if self.packed else "dequantized" if self.dequantized else "plain"
        return kind + ("" if self.threads is None else f"@{self.threads}t")


PLAIN = KernelChoice(packed=False, threads=None)
PACKED = KernelChoice(packed=True, threads=None)
NATIVE = KernelChoice(packed=True, threads=None, native=True)
DEQUANTIZED = KernelChoice(packed=False, threads=None, dequantized=True)
# A weight-only int8 layer's choices: vlmd's int8 kernel for a decode step's rows, the
# dequantized weight's GEMM above them.
INT8_CHOICES = (NATIVE, NATIVE, DEQUANTIZED)


def packing_available(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and _packing_works(weight.dtype)


@functools.cache
def _packing_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this host. Tried, not inferred from the
    CPU flags: its bfloat16 packing needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and raises
    on an AVX2-only host (AMD EPYC family 25 model 1), where bfloat16 then keeps the plain
    product."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    if not (hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        pack_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class SelectedKernel:
    """A layer's product after selection: one choice per M bucket."""

    def __init__(self, choices: tuple[KernelChoice, ...], weight: torch.Tensor | None, packed: torch.Tensor | None,
                 panels: PackedPanels | None = None, storage: tuple[torch.Tensor, ...] = ()):
        self.weight = weight
        self.packed = packed
        # The packed weight as vlmd's kernel reads it (verified on this layer's values, or
        # built by vlmd: then ``storage`` holds it), or None.
        self.panels = panels
        self.storage = storage
        self.choices = choices
        # A packed product of fewer rows is computed on this many (zeros below): see
        # ``padded_rows``; 0 = never. Set for the whole model by the selection.
        self.pad_rows = 0

    @property
    def choices(self) -> tuple[KernelChoice, ...]:
        return self._choices

    @choices.setter
    def choices(self, choices: tuple[KernelChoice, ...]) -> None:
        if len(choices) != len(M_BUCKETS):
            raise ValueError(f"need one kernel choice per M bucket ({len(M_BUCKETS)}), got {len(choices)}")
        if any(c.packed and not c.native for c in choices) and self.packed is None:
            raise ValueError("a packed choice needs the packed weight")
        if any(c.native for c in choices) and self.panels is None:
            raise ValueError("a native choice needs the packed weight's verified panel layout")
        if any(c.dequantized for c in choices) and (self.panels is None or self.panels.dtype != torch.int8):
            raise ValueError("a dequantized choice needs int8 panels")
        if any(not c.packed and not c.dequantized for c in choices) and self.weight is None:
            raise ValueError("a plain choice needs the plain weight")
        self._choices = choices

    def choice_for(self, rows: int) -> KernelChoice:
        """The choice of the smallest M bucket holding ``rows``."""
        for (largest, _), candidate in zip(M_BUCKETS, self.choices):
            if rows <= largest:
                return candidate
        return self.choices[-1]

    def native_panels(self, rows: int) -> PackedPanels | None:
        """The panels vlmd's kernel reads where it is this product's choice at ``rows``
        (at the process's thread count), else None: what a caller running the kernel
        itself (``layers/cpu/decoder_step.py``) may use in its place."""
        choice = self.choice_for(rows)
        return self.panels if self.panels is not None and choice.native and choice.threads is None else None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        choice = self.choice_for(rows)
        if 0 < rows < self.pad_rows and choice.packed and not choice.native:
            return padded_rows(x, rows, self.pad_rows, lambda wide: self._run(choice, wide, bias))
        return self._run(choice, x, bias)

    def _run(self, choice: KernelChoice, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if choice.threads is None:
            return self._product(choice, x, bias)
        previous = torch.get_num_threads()
        torch.set_num_threads(choice.threads)  # ~0.2 us: cheap enough per call
        try:
            return self._product(choice, x, bias)
        finally:
            torch.set_num_threads(previous)

    def _product(self, choice: KernelChoice, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if choice.native:
            return native_packed_linear(x, self.panels, bias)
        if choice.dequantized:
            return F.linear(x, dequantized(self.storage, self.panels), bias)
        if choice.packed:
            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)


def padded_rows(x: torch.Tensor, rows: int, wide_rows: int, product) -> torch.Tensor:
    """``product`` of ``x`` (``rows`` rows) computed on ``wide_rows`` rows, zeros below, and
    the first ``rows`` of the result kept. Why: in a decode step's sequence of products,
    oneDNN's packed kernel streams the weights of a 1- or 2-row product slower than of a
    4-6-row one (small LLaVA, all 37 products of a step in order, AMD EPYC fam 25 model
    17: 12.1 ms at M = 1, 13.1 at M = 2, 10.1-10.5 at M = 4-6). Each output row depends
    only on its own input row, so the kept rows are the product of ``x`` alone (to float
    rounding: the wider product may sum in another order)."""
    wide = x.new_zeros(wide_rows, x.shape[-1])
    wide[:rows] = x.reshape(rows, x.shape[-1])
    return product(wide)[:rows].reshape(*x.shape[:-1], -1)


def candidates_for(weight: torch.Tensor) -> list[KernelChoice]:
    found = [PLAIN]
    if packing_available(weight):
        found.append(PACKED)
    if torch.get_num_threads() > 1:
        found += [KernelChoice(c.packed, 1) for c in list(found)]
    return found


def measure_choices(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    candidates: list[KernelChoice],
    rounds: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    streamed: bool = False,
) -> tuple[tuple[KernelChoice, ...], dict[str, dict[str, float]]]:
    """The fastest candidate per M bucket, and every timing (ms, best of ``rounds``).

    Candidates run interleaved round by round, so a burst of load from another process
    slows all of them rather than one. One thread is only tried for the small buckets:
    a large product is never faster on fewer cores.

    ``streamed`` (the model's weights outgrow the last-level cache, so a decode step reads
    every weight from memory): the small buckets take the packed weight at all threads
    wherever there is one. Timed in cache, one thread (no fork/join) or plain ``F.linear``
    can win a small shape at M = 1, but streaming from memory both lose, and which shapes
    drew them varied from process to process. Whisper tiny.en's whole decode step, kernels
    forced and alternated in one process (AMD EPYC fam 25 model 17): packed at one thread
    10.8-11.0 ms, at two 7.8-8.2; all packed vs per-shape choices with some plain: 7.82 vs
    8.04, 8.20 vs 8.52, 8.49 vs 8.65, 7.89 vs 8.00, 9.24 vs 9.61 ms (384x384 cold: 65 us
    plain, 40 us packed).
    """
    packed = pack_weight(weight) if any(c.packed for c in candidates) else None
    probe = SelectedKernel((PLAIN,) * len(M_BUCKETS), weight, packed)
    chosen: list[KernelChoice] = []
    timings: dict[str, dict[str, float]] = {}
    generator = torch.Generator().manual_seed(0)
    for index, (_, rows) in enumerate(M_BUCKETS):
        x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
        small = index < len(M_BUCKETS) - 1
        tried = [c for c in candidates if c.threads is None or small]
        if streamed and small:
            tried = [c for c in tried if c.threads is None and c.packed] or [c for c in tried if c.threads is None]
        if len(tried) == 1:  # nothing to compare: no timing at start-up
            chosen.append(tried[0])
            timings[f"M{rows}"] = {}
            continue
        best = {c: float("inf") for c in tried}
        for c in tried:  # warm-up: first calls allocate scratch and build oneDNN primitives
            probe._product(c, x, bias)
        for _ in range(rounds):
            for c in tried:
                probe.choices = (c,) * len(M_BUCKETS)
                started = clock()
                probe(x, bias)
                best[c] = min(best[c], clock() - started)
        winner = min(tried, key=lambda c: best[c])
        packed_tried = [c for c in tried if c.packed]
        if not winner.packed and packed_tried:
            best_packed = min(packed_tried, key=lambda c: best[c])
            if best[best_packed] <= best[winner] * PLAIN_MARGIN:
                winner = best_packed
        chosen.append(winner)
        timings[f"M{rows}"] = {c.name: round(best[c] * 1e3, 4) for c in tried}
    return tuple(chosen), timings
