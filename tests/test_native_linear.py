"""vlmd's small-M product on oneDNN's packed weights (vlmd/layers/cpu/packed_linear.c):
against a float64 reference, its layout check, and how the linear seam offers it."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from vlmd.layers.decoder_structure import DecoderStructure, PreNormLayer
from vlmd.layers.linear import kernels, selection
from vlmd.layers.linear.kernels import M_BUCKETS, NATIVE, PACKED, SelectedKernel, pack_weight, packing_available
from vlmd.layers.linear.layers import ReplicatedLinear
from vlmd.layers.norm import RMSNorm
from vlmd.layers.cpu import library
from vlmd.layers.cpu import packed_linear as native_linear
from vlmd.layers.cpu.packed_linear import PackedPanels, packed_linear

needs_kernel = pytest.mark.skipif(
    not (packing_available(torch.zeros(1)) and native_linear.available()),
    reason="no oneDNN packing or no kernel library built here")
pytestmark = pytest.mark.usefixtures("each_kernel_variant")


def _panels(weight):
    packed = pack_weight(weight)
    panels = PackedPanels.of(weight, packed)
    if panels is None:
        pytest.skip("oneDNN packs this weight in a layout the kernel does not read on this host")
    return packed, panels


def _reference(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", [(4096, 768), (1000, 100), (33, 17), (130, 1000), (64, 16)])
@pytest.mark.parametrize("threads", [1, 2, 7])  # 7 on this host's cores: threads are descheduled and steal
def test_products_match_the_reference(out_features, in_features, threads):
    torch.manual_seed(out_features + in_features)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    packed, panels = _panels(weight)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 5, 6, 7, 13, 40):
            x = torch.randn(rows, in_features)
            for with_bias in (None, bias):
                got = packed_linear(x, panels, with_bias)
                assert got.shape == (rows, out_features)
                torch.testing.assert_close(got.double(), _reference(x, weight, with_bias), rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(previous)


@needs_kernel
def test_strided_three_dimensional_and_empty_inputs():
    torch.manual_seed(1)
    weight = torch.randn(96, 80)
    packed, panels = _panels(weight)
    wide = torch.randn(5, 160)[:, :80]  # rows 160 floats apart
    close = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed_linear(wide, panels, None).double(), _reference(wide, weight, None), **close)
    batched = torch.randn(2, 3, 80)
    assert packed_linear(batched, panels, None).shape == (2, 3, 96)
    torch.testing.assert_close(packed_linear(batched, panels, None).double(), _reference(batched, weight, None),
                               **close)
    assert packed_linear(torch.randn(0, 80), panels, None).shape == (0, 96)
    with pytest.raises(ValueError, match="features"):
        packed_linear(torch.randn(1, 79), panels, None)


@needs_kernel
def test_the_layout_is_checked_on_the_layer_s_own_values():
    torch.manual_seed(2)
    weight = torch.randn(128, 64)
    packed, panels = _panels(weight)
    assert panels.out_features == 128 and panels.in_features == 64 and panels.panel_width % 16 == 0
    # One value changed in the packed copy: the layout no longer holds this weight.
    corrupted = pack_weight(weight)
    address = torch.ops.mkldnn.data_ptr(corrupted)
    ctypes.c_float.from_address(address + 4 * 77).value += 1.0
    assert PackedPanels.of(weight, corrupted) is None
    assert PackedPanels.of(weight.t().contiguous(), pack_weight(weight.t().contiguous())) is not None
    assert PackedPanels.of(weight, weight) is None  # not a packed tensor


@pytest.mark.skipif(not packing_available(torch.zeros(1, dtype=torch.bfloat16)),
                    reason="oneDNN packs bfloat16 only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT")
@needs_kernel
def test_onednn_s_bfloat16_packing_is_checked_on_the_layer_s_own_values():
    torch.manual_seed(2)
    weight = torch.randn(128, 64)
    bf16 = weight.bfloat16()
    # oneDNN packs bfloat16 K-paired where the host has AVX512-BF16; on AVX-512 without it
    # (Intel Xeon family 6 model 207) in another layout, which the check refuses: skipped.
    _, found = _panels(bf16)
    assert found.dtype == torch.bfloat16
    corrupted = pack_weight(bf16)
    ctypes.c_uint16.from_address(torch.ops.mkldnn.data_ptr(corrupted) + 2 * 77).value ^= 1 << 6
    assert PackedPanels.of(bf16, corrupted) is None
    assert PackedPanels.of(bf16, pack_weight(weight)) is None  # a float32 packing of it


def _hand_packed(weight, width):
    """``weight`` [N, K] in the layout the kernel reads, packed here rather than by oneDNN:
    panels of ``width`` columns, K-major, bfloat16 with K in pairs; the padding (the last
    panel's columns, K to an even length) is NaN, which the kernel must never read."""
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    n_len, k_len = weight.shape
    padded_n, padded_k = -(-n_len // width) * width, -(-k_len // pair) * pair
    full = torch.full((padded_n, padded_k), float("nan"), dtype=weight.dtype)
    full[:n_len, :k_len] = weight
    # (n, k) at ((n // B) * Kp + (k // P) * P) * B + (n % B) * P + k % P
    packed = full.reshape(padded_n // width, width, padded_k // pair, pair).permute(0, 2, 1, 3).contiguous()
    return packed, PackedPanels(packed.data_ptr(), n_len, k_len, width, padded_k, weight.dtype)


needs_kernel_only = pytest.mark.skipif(not native_linear.available(), reason="no kernel library built here")


@needs_kernel_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", [(130, 1001), (64, 16), (33, 17)])
@pytest.mark.parametrize("threads", [1, 2])
def test_both_readers_on_panels_packed_here_on_any_host(dtype, out_features, in_features, threads):
    # Whatever oneDNN does on this host (AVX2-only hosts pack no bfloat16 at all), the
    # kernel's readers and layout checks are exercised on panels laid out by the test.
    torch.manual_seed(out_features + in_features)
    weight, bias = torch.randn(out_features, in_features).to(dtype), torch.randn(out_features).to(dtype)
    kernel = native_linear._kernel()
    check = "vlmd_packed_bf16_layout_matches" if dtype == torch.bfloat16 else "vlmd_packed_layout_matches"
    chunk = "vlmd_packed_linear_bf16_chunk" if dtype == torch.bfloat16 else "vlmd_packed_linear_chunk"
    width = max(64, kernel[chunk]())
    packed, panels = _hand_packed(weight, width)
    plain = weight.contiguous()
    assert kernel[check](plain.data_ptr(), packed.data_ptr(), out_features, in_features, width, panels.padded_k, 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 5, 7, 13):
            x = torch.randn(rows, in_features).to(dtype)
            for with_bias in (None, bias):
                got = packed_linear(x, panels, with_bias)
                assert got.shape == (rows, out_features) and got.dtype == dtype
                reference = _reference(x, weight, with_bias)
                if dtype == torch.float32:
                    torch.testing.assert_close(got.double(), reference, rtol=1e-4, atol=1e-4)
                else:  # exact products summed in float32, rounded once: within a bfloat16 step
                    assert ((got.double() - reference).abs() <= reference.abs().clamp(min=1.0) * 2**-7).all()
    finally:
        torch.set_num_threads(previous)
    packed.view(-1)[0] += 1  # weight (0, 0) changed
    assert not kernel[check](plain.data_ptr(), packed.data_ptr(), out_features, in_features, width,
                             panels.padded_k, 1)


needs_bf16_packing = pytest.mark.skipif(
    not (packing_available(torch.zeros(1, dtype=torch.bfloat16)) and native_linear.available()),
    reason="no oneDNN bfloat16 packing or no kernel library built here")


# Both bfloat16 readers: widening to float32 FMAs, and AVX512-BF16's dot product where the
# host has it (the default there).
BF16_READERS = [pytest.param(False, id="widened"), pytest.param(True, id="dot")]


@pytest.fixture
def bf16_reader(request, each_kernel_variant):
    previous = native_linear.bf16_dot_products()
    if native_linear.bf16_dot_products(request.param) != request.param:
        pytest.skip(f"no AVX512-BF16 on this host, or the {each_kernel_variant} kernel variant has no dot product")
    yield request.param
    native_linear.bf16_dot_products(previous)


@needs_kernel_only
@pytest.mark.parametrize("bf16_reader", BF16_READERS, indirect=True)
@pytest.mark.parametrize("out_features,in_features", [(130, 1001), (33, 17), (64, 16)])
def test_the_bfloat16_readers_on_float32_rows_and_nan_padding(bf16_reader, out_features, in_features):
    # The fused decode step hands bfloat16 panels float32 rows. The widening reader takes
    # them as they are; the dot product rounds them to bfloat16 first (to nearest even):
    # each result is the exact product of what it read, summed in float32. Panels packed
    # by the test with NaN padding (odd K: half of the last pair) that neither may read.
    torch.manual_seed(out_features + 7 * in_features)
    weight = torch.randn(out_features, in_features).bfloat16()
    packed, panels = _hand_packed(weight, max(64, native_linear._kernel()["vlmd_packed_linear_bf16_chunk"]()))
    for rows in (1, 2, 4, 5, 9):
        x = torch.randn(rows, in_features)
        got = packed_linear(x, panels, None).double()
        # Rows inside a wider buffer whose columns past K are NaN: never read (odd K's last pair).
        wide = torch.full((rows, in_features + 3), float("nan"))
        wide[:, :in_features] = x
        assert torch.equal(packed_linear(wide[:, :in_features], panels, None).double(), got)
        read = x.bfloat16().double() if bf16_reader and rows >= 2 else x.double()
        expected, magnitude = read @ weight.double().T, read.abs() @ weight.double().abs().T
        assert (got - expected).abs().le(magnitude * 2e-6 + 1e-30).all()  # float32 sums of exact products
        widened = x.double() @ weight.double().T
        rounded = bf16_reader and rows >= 2  # one row is always widened (its bytes bound it either way)
        assert (got - widened).abs().gt(magnitude * 2e-6).any() == rounded  # the rows were rounded, or not


@needs_bf16_packing
@pytest.mark.parametrize("bf16_reader", BF16_READERS, indirect=True)
@pytest.mark.parametrize("out_features,in_features", [(4096, 768), (1000, 100), (33, 17), (130, 1001), (64, 16)])
@pytest.mark.parametrize("threads", [1, 2, 7])
def test_bfloat16_products_match_the_reference_and_onednn(bf16_reader, out_features, in_features, threads):
    # Exact bfloat16 products summed in float32, rounded to bfloat16 once: the reference
    # rounded the same way, within a bfloat16 step; oneDNN's own product within two.
    torch.manual_seed(out_features * 3 + in_features)
    weight, bias = torch.randn(out_features, in_features).bfloat16(), torch.randn(out_features).bfloat16()
    packed, panels = _panels(weight)
    assert panels.dtype == torch.bfloat16
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 4, 5, 9, 40):
            x = torch.randn(rows, in_features).bfloat16()
            for with_bias in (None, bias):
                got = packed_linear(x, panels, with_bias)
                assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
                reference = _reference(x, weight, with_bias)
                step = reference.abs().clamp(min=1.0) * 2**-7  # one bfloat16 step (8-bit mantissa)
                assert ((got.double() - reference).abs() <= step).all()
                onednn = kernels.packed_linear(x, packed, with_bias)
                assert ((got.double() - onednn.double()).abs() <= 2 * step).all()
    finally:
        torch.set_num_threads(previous)


def test_a_native_choice_needs_verified_panels():
    weight = torch.randn(8, 4)
    with pytest.raises(ValueError, match="panel layout"):
        SelectedKernel((NATIVE,) * len(M_BUCKETS), weight, weight)


@needs_kernel
def test_native_mode_takes_the_small_buckets_and_leaves_prefill_to_onednn(monkeypatch):
    torch.manual_seed(3)
    layer = ReplicatedLinear(80, 96, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    _panels(weight)  # skips where oneDNN's float32 packing is not one the kernel reads
    model = torch.nn.Sequential(layer)
    selection._DECISIONS.clear()
    selection.select_linear_kernels(model, "native")
    assert [c.name for c in layer.kernel.choices] == ["native", "native", "packed"]
    assert layer.weight is None  # the packed copy is the only one kept
    calls = []
    real = native_linear.packed_linear
    monkeypatch.setattr(kernels, "native_packed_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 8, 32, 33, 200):
        x = torch.randn(rows, 80)
        torch.testing.assert_close(layer(x).double(), _reference(x, weight, bias), rtol=1e-4, atol=1e-4)
    assert calls == [1, 8, 32]


@needs_bf16_packing
def test_a_bfloat16_layer_takes_the_bfloat16_reader_for_products_and_native_steps(monkeypatch):
    torch.manual_seed(4)
    layer = ReplicatedLinear(80, 96, bias=True).to(torch.bfloat16)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    _panels(layer.weight.detach())  # skips where oneDNN's bfloat16 packing is not one the kernel reads
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    selection._DECISIONS.clear()
    selection.select_linear_kernels(torch.nn.Sequential(layer), "native")
    assert [c.name for c in layer.kernel.choices] == ["native", "native", "packed"]
    assert layer.kernel.panels.dtype == torch.bfloat16
    assert layer.kernel.native_panels(1) is layer.kernel.panels  # the native decoder step reads them too
    calls = []
    real = native_linear.packed_linear
    monkeypatch.setattr(kernels, "native_packed_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 8, 33):
        x = torch.randn(rows, 80).bfloat16()
        got = layer(x)
        reference = _reference(x, weight, bias)
        assert got.dtype == torch.bfloat16
        assert ((got.double() - reference).abs() <= reference.abs().clamp(min=1.0) * 2**-7).all()
    assert calls == [1, 8]


def test_a_bfloat16_layer_whose_onednn_layout_the_kernel_cannot_read_gets_its_own_panels(monkeypatch):
    # As on an AMX host (Intel family 6 model 207), where oneDNN packs bfloat16 for AMX and
    # the AVX-512 kernel does not read that layout: the layer keeps oneDNN's copy for the
    # large products and still hands the native step bfloat16 panels of its own.
    if not native_linear.available():
        pytest.skip("no kernel library built here")
    torch.manual_seed(5)
    layer = ReplicatedLinear(80, 96, bias=False).to(torch.bfloat16)
    layer.weight.data.normal_()
    weight = layer.weight.detach().clone()
    onednn_copy = weight.clone()
    monkeypatch.setattr(selection, "packing_available", lambda w: True)
    monkeypatch.setattr(selection, "pack_weight", lambda w: onednn_copy)
    monkeypatch.setattr(selection.PackedPanels, "of", classmethod(lambda cls, w, packed: None))
    selection._DECISIONS.clear()
    selection.select_linear_kernels(torch.nn.Sequential(layer), "native")
    assert layer.kernel.packed is onednn_copy
    assert layer.kernel.panels is not None and layer.kernel.panels.dtype == torch.bfloat16
    assert layer.kernel.native_panels(1) is layer.kernel.panels
    x = torch.randn(1, 80).bfloat16()
    reference = _reference(x, weight, None)
    assert ((layer(x).double() - reference).abs() <= reference.abs().clamp(min=1.0) * 2**-7).all()


def test_without_a_library_native_mode_keeps_onednn():
    if not packing_available(torch.zeros(1)):
        pytest.skip("no oneDNN packing here")
    layer = ReplicatedLinear(16, 32, bias=False)
    selection._DECISIONS.clear()
    try:
        library.use(None)  # an install that built no kernel library
        selection.select_linear_kernels(torch.nn.Sequential(layer), "native")
    finally:
        library.reset()
    assert layer.kernel.panels is None and [c.name for c in layer.kernel.choices] == ["packed"] * 3
    assert layer(torch.randn(1, 16)).shape == (1, 32)


class _TimedKernel:
    """Stands in for a layer's kernel: each call advances a fake clock by what the current
    configuration costs at that many rows (``costs(rows, pad_rows, native)``)."""

    def __init__(self, now, costs, layers, panels=True):
        self.now, self.costs, self.layers = now, costs, layers
        self.packed = torch.zeros(4, 8)
        self.weight = None
        self.panels = PackedPanels(0, 8, 4, 64, 4) if panels else None  # never read: the fake runs no kernel
        self.choices = (PACKED,) * len(M_BUCKETS)
        self.pad_rows = 0

    def __call__(self, x, bias):
        rows = x.shape[0]
        bucket = next(index for index, (largest, _) in enumerate(M_BUCKETS) if rows <= largest)
        self.now[0] += self.costs(rows, self.pad_rows, self.choices[bucket].native) / self.layers


def _layers(now, costs, panels=True, count=2):
    layers = [ReplicatedLinear(8, 4) for _ in range(count)]
    for layer in layers:
        layer.kernel = _TimedKernel(now, costs, count, panels)
    return layers


@pytest.mark.parametrize("fastest,expected", [(6, 6), (4, 4), (0, 0), (None, 0)])
def test_padding_is_chosen_by_timing_the_model_s_products_in_order(fastest, expected):
    now = [0.0]
    # None: every padding 1 % slower than none, within PAD_MARGIN, so no padding.
    if fastest is None:
        costs = lambda rows, pad, native: 1.01 if pad else 1.0  # noqa: E731
    else:
        costs = lambda rows, pad, native: 1.0 if pad == fastest else 1.5  # noqa: E731
    layers = _layers(now, costs, panels=False)
    decided = selection.choose_small_products(layers, clock=lambda: now[0], budget_s=100.0)
    assert decided["pad_rows"] == expected and decided["native_buckets"] == []
    assert all(layer.kernel.pad_rows == expected for layer in layers)
    assert all(not c.native for layer in layers for c in layer.kernel.choices)


@pytest.mark.parametrize("native_cost,expected", [
    ({1: 0.5, 8: 0.5}, ["native", "native", "packed"]),
    ({1: 0.5, 8: 2.0}, ["native", "packed", "packed"]),
    ({1: 2.0, 8: 0.5}, ["packed", "native", "packed"]),
    ({1: 0.99, 8: 0.99}, ["packed", "packed", "packed"]),  # 1 % faster: within NATIVE_MARGIN
])
def test_the_native_kernel_is_kept_per_bucket_where_it_is_faster(native_cost, expected):
    now = [0.0]
    costs = lambda rows, pad, native: native_cost[rows] if native else (0.9 if pad == 6 else 1.0)  # noqa: E731
    layers = _layers(now, costs)
    decided = selection.choose_small_products(layers, clock=lambda: now[0], budget_s=100.0)
    assert [c.name for c in layers[0].kernel.choices] == expected
    # Padding is still chosen for the products left on oneDNN (6 is 10 % faster than none).
    assert decided["pad_rows"] == 6


def _bind_costing(now, cost_of_rows, count):
    """A stand-in for packed_linear.bound_product: each call advances the fake clock."""
    def bind(x, panels):
        rows = x.shape[0]
        return lambda: now.__setitem__(0, now[0] + cost_of_rows[rows] / count)
    return bind


@pytest.mark.parametrize("step_cost,expected,step_buckets", [
    # Through the module calls vlmd's kernel loses (1.2 against 1.0), run as a native step
    # would run them it wins: every layer with panels takes it, and the step engages.
    ({1: 0.5, 8: 0.5}, ["native", "native", "packed"], ["M<=4", "M<=32"]),
    ({1: 0.5, 8: 1.5}, ["native", "packed", "packed"], ["M<=4"]),
    ({1: 0.99, 8: 0.99}, ["packed", "packed", "packed"], []),  # within NATIVE_MARGIN
])
def test_a_native_step_s_products_are_timed_as_the_step_runs_them(step_cost, expected, step_buckets):
    now = [0.0]
    costs = lambda rows, pad, native: 1.2 if native else 1.0  # noqa: E731
    layers = _layers(now, costs)
    decided = selection.choose_small_products(layers, clock=lambda: now[0], budget_s=100.0, step_layers=layers,
                                              bind=_bind_costing(now, step_cost, len(layers)))
    assert [c.name for c in layers[0].kernel.choices] == expected
    assert decided["native_step_buckets"] == step_buckets
    assert set(decided["sequence_ms"]["M1"]) == {"onednn", "onednn+pad4", "onednn+pad6", "native", "step"}


def test_no_step_is_timed_when_one_of_its_products_has_no_panels():
    now = [0.0]
    costs = lambda rows, pad, native: 1.2 if native else 1.0  # noqa: E731
    layers = _layers(now, costs)
    layers[1].kernel.panels = None  # the step cannot run: it reads every product's panels
    decided = selection.choose_small_products(layers, clock=lambda: now[0], budget_s=100.0, step_layers=layers,
                                              bind=_bind_costing(now, {1: 0.1, 8: 0.1}, len(layers)))
    assert "step" not in decided["sequence_ms"]["M1"] and decided["native_step_buckets"] == []
    assert [c.name for c in layers[0].kernel.choices] == ["packed"] * 3


class _StepModel(torch.nn.Module):
    """A model whose described decoder (one stand-in layer) has a and b as its products:
    a fused decode step would run those two, not the head."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = ReplicatedLinear(64, 128), ReplicatedLinear(128, 64), ReplicatedLinear(64, 64)
        for layer in (self.a, self.b, self.head):
            layer.weight.data.normal_()
        norm = RMSNorm(64, 1e-6)
        self.decoder_structure = DecoderStructure(
            layers=(PreNormLayer(norm, self.a, self.b, norm, self.a, self.b),), final_norm=norm, heads=2,
            kv_heads=1, head_dim=32, intermediate=64, scale=32**-0.5, eps=1e-6, activation="silu")


def _select_with_plain_shapes(monkeypatch, **options):
    """A _StepModel through select_linear_kernels("auto") where per-shape timing picks
    F.linear everywhere (as it does for the tiny LLaVA's shapes); (model, report)."""
    monkeypatch.setattr(selection, "measure_choices",
                        lambda weight, bias, candidates, streamed: ((kernels.PLAIN,) * len(M_BUCKETS), {}))
    monkeypatch.setattr(selection, "_DECISIONS", {})
    model = _StepModel()
    with torch.inference_mode():
        return model, selection.select_linear_kernels(model, "auto", **options)


@needs_kernel
def test_a_native_step_s_products_get_panels_whatever_their_own_timing_chose(monkeypatch):
    _panels(torch.randn(128, 64)), _panels(torch.randn(64, 128))  # skip where oneDNN's packing is not read
    # The step's products are packed and verified anyway, their plain weights kept.
    model, report = _select_with_plain_shapes(monkeypatch)
    assert not report["streamed"]
    for layer in (model.a, model.b):
        assert layer.kernel.panels is not None and layer.kernel.weight is not None
    assert model.head.kernel.packed is None  # not the step's: nothing to pack it for
    assert "step" in report["sequence_ms"]["M1"]
    for layer in (model.a, model.b, model.head):
        for rows in (1, 3, 40):  # every M bucket
            x = torch.randn(rows, layer.kernel.weight.shape[1])
            reference = F.linear(x, layer.kernel.weight, layer.bias)
            torch.testing.assert_close(layer.kernel(x, layer.bias), reference, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_no_step_is_timed_where_the_native_step_cannot_run(monkeypatch):
    # With torch's attention (--attention-kernels torch) the step keeps the modules.
    model, report = _select_with_plain_shapes(monkeypatch, native_steps=False)
    assert all(layer.kernel.packed is None for layer in (model.a, model.b, model.head))
    assert report["native_step_buckets"] == [] and "step" not in report["sequence_ms"].get("M1", {})


@needs_kernel
def test_a_bound_product_computes_the_product():
    weight = torch.randn(96, 64)
    packed, panels = _panels(weight)  # packed stays alive as long as the panels: they hold its address
    x = torch.randn(5, 64)
    call = native_linear.bound_product(x, panels)
    torch.testing.assert_close(call(), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    x.mul_(2)  # the call reads its input where it lies, every time
    torch.testing.assert_close(call(), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        native_linear.bound_product(torch.randn(64, 5).t(), panels)


def test_the_decode_products_are_not_timed_past_their_budget():
    now = [0.0]
    costs = lambda rows, pad, native: 0.5 if native else 1.0  # noqa: E731
    layers = _layers(now, costs, count=1)
    # The warm-up round alone (four passes at M = 1) outlasts a 1 s budget: nothing changes.
    assert selection.choose_small_products(layers, clock=lambda: now[0], budget_s=1.0)["native_buckets"] == []
    assert selection.choose_small_products(layers, clock=lambda: now[0], budget_s=0.0)["native_buckets"] == []
    assert [c.name for c in layers[0].kernel.choices] == ["packed"] * 3
    decided = selection.choose_small_products(layers, clock=lambda: now[0], budget_s=100.0)
    assert decided["native_buckets"] == ["M<=4", "M<=32"]


def test_each_small_bucket_gets_its_share_of_the_budget():
    # A pass at M = 1 costs 1 s (four candidates a round: 4 s); 12 s would let M = 1 run its
    # warm-up and two rounds and leave M = 8 nothing, were the budget not shared out.
    now = [0.0]
    costs = lambda rows, pad, native: 0.5 if native else 1.0  # noqa: E731
    layers = _layers(now, costs, count=1)
    decided = selection.choose_small_products(layers, clock=lambda: now[0], budget_s=18.0)
    assert set(decided["sequence_ms"]) == {"M1", "M8"} and decided["sequence_ms"]["M8"]
    assert decided["native_buckets"] == ["M<=4", "M<=32"]


@needs_kernel
def test_the_decode_products_are_timed_even_when_the_shapes_used_the_budget(monkeypatch):
    """A slow start-up's per-shape timing may use the whole budget; the decode products
    still get their own minimum, or the kernel would go untimed for the server's life."""
    budgets = []
    real = selection.choose_small_products

    def recording(layers, **options):
        budgets.append(options["budget_s"])
        return real(layers, **options)

    monkeypatch.setattr(selection, "choose_small_products", recording)
    model = torch.nn.Sequential(ReplicatedLinear(64, 256), ReplicatedLinear(256, 64))
    with torch.inference_mode():
        report = selection.select_linear_kernels(model, "auto", budget_s=0.0)
    assert budgets and budgets[0] >= selection.SMALL_PRODUCTS_MIN_S
    assert report["sequence_ms"]["M1"]  # timed, whatever it chose
