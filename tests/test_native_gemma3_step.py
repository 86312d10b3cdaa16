"""Gemma 3's layer through the native decode step (``layers/cpu/decoder_step.c``): four
``1 + w`` norms a layer (input, after attention, before and after the MLP), q/k head norms,
GELU-tanh, a rotary table per layer type (the local base on sliding layers, the global base
with linear scaling on full ones), ``query_pre_attn_scalar``, and sliding-window layers in a
KV group of their own whose tables hold FREED entries before each window. A float32 step
equals the module path bit for bit (outputs and every cache) in every kernel variant this
host runs; bfloat16 and int8 weights step natively as other families' do; and the native
GELU-tanh the two paths share is torch's to float32 rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma3TextConfig

from decode_step_support import BLOCK, run_step
from vlmd.layers.attention import SequenceChunk
from vlmd.layers.attention.backend import LayerCache
from vlmd.layers.cpu import decoder_step, elementwise, fused_step
from vlmd.layers.linear import select_linear_kernels
from vlmd.layers.linear.quantize import quantize_decoder
from vlmd.sched.kv_managers import FREED
from vlmd_gemma3.decoder import Gemma3TextModel

pytestmark = [
    pytest.mark.skipif(not decoder_step.available(), reason="no kernel library was built in this install"),
    pytest.mark.usefixtures("each_kernel_variant"),
]

HIDDEN, WINDOW, BLOCKS = 64, 24, 400
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def _gemma3(mode: str = "native", dtype=torch.float32, head_dim: int = 32) -> Gemma3TextModel:
    config = Gemma3TextConfig(
        vocab_size=101, hidden_size=HIDDEN, intermediate_size=160, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, query_pre_attn_scalar=24,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, max_position_embeddings=4096, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}})
    model = Gemma3TextModel(config, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Norm weights around 0 (the scale is 1 + w), distinct per column, so that a norm
            # skipped, run as w, or with another norm's weight changes the result.
            param.copy_(0.3 * torch.randn_like(param) if name.endswith("norm.weight") else
                        0.08 * torch.randn_like(param))
    model = model.eval().to(dtype)
    select_linear_kernels(model, mode)
    if mode == "native" and any(p.kernel.panels is None for p in model.decoder_structure.products()):
        pytest.skip("oneDNN packs these weights in a layout the native kernel does not read on this host")
    return model


def _chunks(contexts, seed=0):
    """Decodes whose full layers read group 0's tables and whose sliding layers read group
    1's: other blocks, FREED before the window's first block (as the scheduler frees them)."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randperm(BLOCKS - 1, generator=generator).add(1).tolist()
    chunks = []
    for context in contexts:
        count = -(-(context + 1) // BLOCK)
        full = [pool.pop() for _ in range(count)]
        first = max(0, context + 1 - WINDOW) // BLOCK
        windowed = [FREED] * first + [pool.pop() for _ in range(count - first)]
        chunks.append(SequenceChunk.of({0: full, 1: windowed}, context, 1))
    return chunks


def _caches(model, dtype=torch.float32, seed=1):
    """A random (K, V) per layer, each a ``LayerCache`` of its group: 1 for sliding layers."""
    generator = torch.Generator().manual_seed(seed)
    spec = model.kv_spec
    shape = (BLOCKS * BLOCK, spec.num_kv_heads, spec.head_dim)
    return [LayerCache(*(torch.randn(shape, generator=generator).to(dtype) for _ in range(2)),
                       group=int(window is not None)) for window in spec.layer_windows]


def _copies(caches):
    return [LayerCache(k.clone(), v.clone(), group=cache.group) for cache in caches for k, v in [cache]]


@pytest.mark.parametrize("head_dim", [32, 20])  # 20: a head that is not a whole number of vectors
@pytest.mark.parametrize("contexts", [[37], [5, 300, 64, 17, 900], [23, 24, 25, 48]])  # about the window's edge
def test_the_gemma3_step_is_the_module_path_bit_for_bit(monkeypatch, head_dim, contexts):
    model = _gemma3(head_dim=head_dim)
    structure = model.decoder_structure
    assert fused_step.unsupported(structure) is None
    assert [layer.window for layer in structure.layers] == [WINDOW, None, WINDOW, WINDOW, None]
    assert [layer.rotary for layer in structure.layers] == [1, 0, 1, 1, 0]  # "full_attention" sorts first
    chunks = _chunks(contexts)
    embeds = torch.randn(len(chunks), HIDDEN, generator=torch.Generator().manual_seed(2))
    positions = torch.tensor(contexts)
    caches = _caches(model)
    stepped_caches, module_caches = _copies(caches), _copies(caches)
    stepped, calls = run_step(model, embeds, positions, chunks, stepped_caches, True, monkeypatch)
    module, none = run_step(model, embeds, positions, chunks, module_caches, False, monkeypatch)
    assert (calls, none) == (1, 0)  # the step did run natively, the other did not
    assert torch.equal(stepped, module)
    for stepped_cache, module_cache in zip(stepped_caches, module_caches):
        assert all(torch.equal(a, b) for a, b in zip(stepped_cache, module_cache))
    # Each layer wrote its K/V at its own group's slot only.
    for cache, original in zip(stepped_caches, caches):
        written = (cache[0] != original[0]).any(-1).any(-1).nonzero().flatten().tolist()
        table_of = [chunk.for_group(cache.group).block_ids for chunk in chunks]
        expected = sorted(table[c // BLOCK] * BLOCK + c % BLOCK for table, c in zip(table_of, contexts))
        assert sorted(written) == expected


def test_a_sliding_layer_reads_its_window_alone(monkeypatch):
    # Keys before a decode's window, in the sliding layers' caches, poisoned with NaN (their
    # table there still names real blocks, as after the scheduler handed freed blocks on):
    # both paths read only the window, so both stay finite and equal; the same step with
    # the windows dropped from the structure reads them (the poison is where a read lands).
    model = _gemma3()
    contexts = [70, 41, 99]
    chunks = [dataclasses.replace(chunk, tables={0: chunk.tables[0],
                                                 1: [chunk.tables[0][0] if b == FREED else b
                                                     for b in chunk.tables[1]]}) for chunk in _chunks(contexts)]
    caches = _caches(model)
    for chunk, context in zip(chunks, contexts):
        for position in range(context + 1 - WINDOW):
            block = chunk.tables[1][position // BLOCK]
            for cache in caches:
                if cache.group == 1:
                    cache[0][block * BLOCK + position % BLOCK] = float("nan")
    embeds = torch.randn(len(chunks), HIDDEN, generator=torch.Generator().manual_seed(5))
    positions = torch.tensor(contexts)
    stepped, calls = run_step(model, embeds, positions, chunks, _copies(caches), True, monkeypatch)
    module, _ = run_step(model, embeds, positions, chunks, _copies(caches), False, monkeypatch)
    assert calls == 1 and torch.isfinite(stepped).all() and torch.equal(stepped, module)
    structure = model.decoder_structure
    model.decoder_structure = dataclasses.replace(
        structure, layers=tuple(dataclasses.replace(layer, window=None) for layer in structure.layers))
    unwindowed, calls = run_step(model, embeds, positions, chunks, _copies(caches), True, monkeypatch)
    assert calls == 1 and torch.isnan(unwindowed).any()


def test_bfloat16_and_int8_gemma3_step_natively_close_to_float32(monkeypatch):
    reference = _gemma3(mode="plain")
    contexts = [37, 120, 9]
    chunks = _chunks(contexts)
    embeds = torch.randn(len(contexts), HIDDEN, generator=torch.Generator().manual_seed(3))
    positions = torch.tensor(contexts)
    caches = _caches(reference)
    exact, _ = run_step(reference, embeds, positions, chunks, _copies(caches), False, monkeypatch)

    half = _gemma3(dtype=torch.bfloat16)
    half_caches = [LayerCache(k.bfloat16(), v.bfloat16(), group=c.group) for c in caches for k, v in [c]]
    stepped, calls = run_step(half, embeds.bfloat16(), positions, chunks, _copies(half_caches), True, monkeypatch)
    module, none = run_step(half, embeds.bfloat16(), positions, chunks, _copies(half_caches), False, monkeypatch)
    assert (calls, none) == (1, 0) and stepped.dtype == module.dtype == torch.bfloat16
    step_error, module_error = ((x.float() - exact).abs().max() for x in (stepped, module))
    # bfloat16 keeps 8 significand bits: outputs of order 1 differ by a few 2^-8.
    assert step_error <= module_error and step_error < 0.05, (step_error, module_error)

    quantized = _gemma3(mode="plain")
    layers = quantize_decoder(quantized, "int8")
    assert len(layers) == 4 * len(LAYER_TYPES) + 1  # every product and the LM head
    stepped, calls = run_step(quantized, embeds, positions, chunks, _copies(caches), True, monkeypatch)
    module, none = run_step(quantized, embeds, positions, chunks, _copies(caches), False, monkeypatch)
    assert (calls, none) == (1, 0)
    assert torch.equal(stepped, module)  # int8 panels, float32 activations: the same kernels
    # A sanity bound (per-column int8 scales, ~1 % a weight, through five layers): what the
    # two paths compute is pinned by the equality above.
    assert (stepped - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("width", [7, 16, 160])  # a tail only, whole vectors, both
def test_the_native_gelu_tanh_is_torchs(width):
    gate_up = torch.randn(5, 2 * width, generator=torch.Generator().manual_seed(width)) * 4
    gate_up[0, :width] = torch.linspace(-12, 12, width)  # both tails and the middle
    gate, up = gate_up.split(width, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(elementwise.gelu_tanh_mul(gate_up, width), expected, rtol=2e-6, atol=1e-6)


def test_what_a_structure_adds_to_llamas_is_named():
    structure = _gemma3(mode="plain").decoder_structure
    assert structure.additions() == ["norms after attention and MLP", "norms scaling by 1.0 + weight",
                                     "sliding-window layers", "rotary tables per layer"]
    first, *rest = structure.layers
    with pytest.raises(ValueError, match="post-attention and post-feedforward norms"):
        dataclasses.replace(structure, layers=(dataclasses.replace(first, post_feedforward_norm=None), *rest))
    with pytest.raises(ValueError, match="rotary table 2 of 2"):
        dataclasses.replace(structure, layers=(dataclasses.replace(first, rotary=2), *rest))
