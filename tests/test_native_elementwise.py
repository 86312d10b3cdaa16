"""The native elementwise kernels (``vlmd/layers/cpu/elementwise.c``) against float64
references, and the layers that call them against their own torch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from vlmd.layers.attention import SequenceChunk, attention_backend_for
from vlmd.layers.cpu import elementwise
from vlmd.layers.norm import RMSNorm
from vlmd.models.llama import LlamaForCausalLM

pytestmark = [
    pytest.mark.skipif(not elementwise.available(), reason="no kernel library was built in this install"),
    pytest.mark.usefixtures("each_kernel_variant"),
]

# Widths around the vector size (16 or 8 floats) and real hidden sizes; rows across the
# threshold where the rows are split over threads.
SHAPES = [(1, 5), (3, 16), (7, 33), (8, 768), (600, 768), (97, 2050)]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _rms_reference(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("rows,width", SHAPES)
def test_add_rms_norm_adds_in_place_and_normalises(rows, width, threads):
    torch.manual_seed(rows * 7 + width)
    hidden, delta, weight = torch.randn(rows, width), torch.randn(rows, width), torch.randn(width)
    expected_sum = hidden.double() + delta.double()
    out = elementwise.add_rms_norm(hidden, delta, weight, 1e-6)
    torch.testing.assert_close(hidden.double(), expected_sum, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.double(), _rms_reference(expected_sum, weight, 1e-6), rtol=1e-5, atol=1e-5)
    # Without a delta: the norm alone, the input untouched.
    before = hidden.clone()
    torch.testing.assert_close(elementwise.add_rms_norm(hidden, None, weight, 1e-6).double(),
                               _rms_reference(before, weight, 1e-6), rtol=1e-5, atol=1e-5)
    assert torch.equal(hidden, before)


def test_strided_rows_are_read_and_written_in_place():
    torch.manual_seed(1)
    wide = torch.randn(9, 100)
    hidden, delta = wide[:, :40], torch.randn(9, 60)[:, 10:50]
    untouched = wide[:, 40:].clone()
    expected = hidden.double() + delta.double()
    out = elementwise.add_rms_norm(hidden, delta, torch.ones(40), 1e-5)
    torch.testing.assert_close(wide[:, :40].double(), expected, rtol=0, atol=1e-6)
    assert torch.equal(wide[:, 40:], untouched)
    torch.testing.assert_close(out.double(), _rms_reference(expected, torch.ones(40), 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,width", SHAPES)
def test_silu_mul_matches_float64(rows, width, threads):
    torch.manual_seed(rows + width)
    gate_up = torch.randn(rows, 2 * width) * 6
    gate_up[0, 0], gate_up[-1, min(1, width - 1)] = 95.0, -95.0  # beyond exp's clamp both ways
    expected = F.silu(gate_up[:, :width].double()) * gate_up[:, width:].double()
    got = elementwise.silu_mul(gate_up, width).double()
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows,heads,dim", [(1, 3, 16), (5, 20, 64), (600, 16, 64), (4, 6, 128), (3, 2, 10)])
def test_rotary_rotates_the_first_heads_of_each_row_in_place(rows, heads, dim, threads):
    torch.manual_seed(rows + heads + dim)
    width = heads * dim + 2 * dim  # v's heads after them stay as they are
    x = torch.randn(rows, width)
    angles = torch.randn(rows, dim // 2).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    original = x.clone()
    elementwise.rotary_(x, heads, dim, cos, sin)
    heads_view = original[:, : heads * dim].view(rows, heads, dim).double()
    half = dim // 2
    rotated = torch.cat((-heads_view[..., half:], heads_view[..., :half]), dim=-1)
    expected = heads_view * cos.double().unsqueeze(1) + rotated * sin.double().unsqueeze(1)
    torch.testing.assert_close(x[:, : heads * dim].view(rows, heads, dim).double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(x[:, heads * dim:], original[:, heads * dim:])


def test_bad_shapes_raise_and_other_dtypes_are_not_served():
    with pytest.raises(ValueError):
        elementwise.add_rms_norm(torch.randn(2, 8), torch.randn(2, 7), torch.ones(8), 1e-5)
    with pytest.raises(ValueError):
        elementwise.silu_mul(torch.randn(2, 10), 6)
    with pytest.raises(ValueError):
        elementwise.rotary_(torch.randn(2, 16), 2, 8, torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(ValueError):  # tables of another dtype would be misread
        elementwise.rotary_(torch.randn(2, 16), 2, 8, torch.randn(2, 8).double(), torch.randn(2, 8).double())
    with pytest.raises(ValueError):
        elementwise.add_rms_norm(torch.randn(2, 8), None, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError):
        elementwise.silu_mul(torch.randn(12, 2).t(), 6)
    assert not elementwise.serves(torch.randn(2, 8, dtype=torch.bfloat16))
    assert not elementwise.serves(torch.randn(8, 2).t())  # rows not contiguous
    assert not elementwise.serves(torch.randn(8))
    assert elementwise.serves(torch.randn(2, 8), torch.randn(3, 8))


def test_rms_norm_layer_fuses_the_add_like_its_torch_ops(monkeypatch):
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    residual, delta = torch.randn(6, 48), torch.randn(6, 48)
    native_out, native_sum = norm.add_forward(residual.clone(), delta)
    monkeypatch.setattr(elementwise, "serves", lambda *tensors: False)
    torch_out, torch_sum = norm.add_forward(residual.clone(), delta)
    torch.testing.assert_close(native_sum, torch_sum, rtol=0, atol=1e-6)
    torch.testing.assert_close(native_out, torch_out, rtol=1e-5, atol=1e-5)
    # bfloat16 rows take the bfloat16 twin (test below), whatever serves says.
    monkeypatch.undo()
    half = norm.to(torch.bfloat16)
    out, _ = half.add_forward(residual.bfloat16(), delta.bfloat16())
    assert out.dtype == torch.bfloat16


def test_the_decoder_gives_the_same_states_through_either_path(monkeypatch):
    """A small Llama's step (a decode and a prompt), native elementwise kernels against
    the torch ops; the caller's embeddings are not written."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=50, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    backend = attention_backend_for("cpu", 16, "torch")
    chunks = [SequenceChunk([0, 1], 20, 1), SequenceChunk([2, 3], 0, 30)]
    embeds = torch.randn(31, 64)
    positions = torch.tensor([20] + list(range(30)))
    kept = embeds.clone()

    def run():
        caches = [(torch.zeros(64, 2, 16), torch.zeros(64, 2, 16)) for _ in range(2)]
        generator = torch.Generator().manual_seed(3)
        for k, v in caches:
            k.normal_(generator=generator), v.normal_(generator=generator)
        with torch.inference_mode():
            return model(embeds, positions, backend.prepare_metadata(chunks, 1), caches)

    native = run()
    assert torch.equal(embeds, kept)
    monkeypatch.setattr(elementwise, "serves", lambda *tensors: False)
    torch.testing.assert_close(native, run(), rtol=1e-4, atol=1e-5)


def test_the_elementwise_calls_keep_the_gil_and_the_attention_calls_release_it():
    """Microsecond calls keep the GIL (ctypes' PYTHONAPI flag, as PyDLL sets it): releasing
    it let the event loop's thread take it and the engine wait for it back."""
    import ctypes

    from vlmd.layers.cpu import paged_decode

    for function in elementwise._kernel().values():
        assert function._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    if paged_decode.available():
        assert not paged_decode._kernel()._flags_ & ctypes._FUNCFLAG_PYTHONAPI


def _bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 values lie between a and b (same sign: their bit patterns' distance)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows,width", SHAPES)
def test_bfloat16_norm_and_silu_round_where_torch_rounds(rows, width, threads, monkeypatch):
    # The bfloat16 twins against the layers' own torch ops: the residual sum bit for bit,
    # the norm's and the activation's outputs nearly all equal and none more than two
    # bfloat16 steps apart (the variance is summed in another order, the exponential is
    # vlmd's own: a value one step off before the second rounding may land two off).
    torch.manual_seed(rows * 11 + width)
    norm = RMSNorm(width, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
    residual, delta = torch.randn(rows, width).bfloat16(), torch.randn(rows, width).bfloat16()
    gate_up = (torch.randn(rows, 2 * width) * 4).bfloat16()
    assert elementwise.serves_bf16(residual, delta, norm.weight.view(1, -1))
    native_out, native_sum = norm.add_forward(residual.clone(), delta)
    native_alone = norm(residual)
    native_act = elementwise.silu_mul(gate_up, width)
    monkeypatch.setattr(elementwise, "serves_bf16", lambda *tensors: False)
    torch_out, torch_sum = norm.add_forward(residual.clone(), delta)
    torch_alone = norm(residual)
    torch_act = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    assert native_out.dtype == native_act.dtype == torch.bfloat16
    assert torch.equal(native_sum, torch_sum)
    for native, reference in ((native_out, torch_out), (native_alone, torch_alone), (native_act, torch_act)):
        apart = _bf16_steps_apart(native, reference)
        assert apart.max() <= 2 and apart.float().mean() < 0.01, (apart.max(), apart.float().mean())


def test_bfloat16_rows_of_mixed_dtypes_are_not_served():
    rows = torch.randn(2, 8).bfloat16()
    assert elementwise.serves_bf16(rows, torch.randn(3, 8).bfloat16())
    assert not elementwise.serves_bf16(rows, torch.randn(2, 8))
    assert not elementwise.serves_bf16(torch.randn(8, 2).bfloat16().t())
    with pytest.raises(ValueError):  # a float32 weight for bfloat16 rows would be misread
        elementwise.add_rms_norm(rows, None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError):  # GELU-tanh has no bfloat16 twin: its float32 kernel would misread them
        elementwise.gelu_tanh_mul(torch.randn(2, 16).bfloat16(), 8)


@pytest.mark.parametrize("rows,heads,dim", [(1, 3, 16), (5, 20, 64), (600, 16, 64), (4, 6, 128), (3, 2, 10)])
def test_bfloat16_rotary_is_torchs_bfloat16_rotary_bit_for_bit(rows, heads, dim, threads):
    # Each product and the sum rounded as torch's bfloat16 ops round (rotary.apply_rotary),
    # the heads past `heads` (v's) untouched, in place on rows inside a wider buffer.
    from vlmd.layers.rotary import apply_rotary

    torch.manual_seed(3 * rows + heads + dim)
    width = heads * dim + 2 * dim
    x = (torch.randn(rows, width + 5) * 4).bfloat16()[:, :width]
    angles = torch.randn(rows, dim // 2).repeat(1, 2) * 3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    original = x.clone()
    elementwise.rotary_(x, heads, dim, cos, sin)
    expected = apply_rotary(original[:, : heads * dim].view(rows, heads, dim), cos.unsqueeze(1), sin.unsqueeze(1))
    assert torch.equal(x[:, : heads * dim].view(rows, heads, dim), expected)
    assert torch.equal(x[:, heads * dim:], original[:, heads * dim:])
