"""bfloat16 weights through the native decode step (``layers/cpu/decoder_step.c``): the
step's rows are float32, its products read bfloat16 panels (no bfloat16 instructions, so
on AVX2 hosts too).

- Weight-only bfloat16 (a float32 model whose products read bfloat16 panels): the step
  runs the module path's kernels in its order, so it equals the module path bit for bit.
- A ``--dtype bfloat16`` model: its module path rounds every op's output to bfloat16 and
  the step does not, so the two agree to bfloat16 rounding and the step is the closer to
  the float32 model; the caches it writes are bfloat16, rounded as torch rounds them.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from decode_step_support import BLOCK, random_caches, run_step
from vlmd.layers.attention import SequenceChunk
from vlmd.layers.cpu import decoder_step
from vlmd.layers.cpu.panel_packing import bfloat16_panels
from vlmd.layers.linear import select_linear_kernels
from vlmd.layers.linear.kernels import NATIVE, PLAIN, SelectedKernel
from vlmd.models.llama import LlamaForCausalLM

pytestmark = [
    pytest.mark.skipif(not decoder_step.available(), reason="no kernel library was built in this install"),
    pytest.mark.usefixtures("each_kernel_variant"),
]


def _float_model(qkv_bias: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=101, max_position_embeddings=4096)
    llama = LlamaForCausalLM(config, qkv_bias=qkv_bias).eval()
    with torch.no_grad():
        for param in llama.parameters():
            param.normal_(0, 0.08)
    return llama


def _weight_only_bf16(qkv_bias: bool) -> LlamaForCausalLM:
    """A float32 model whose decoder products read bfloat16 panels of its (rounded) weights."""
    llama = _float_model(qkv_bias)
    select_linear_kernels(llama, "plain")
    for product in llama.decoder_structure.products():
        rounded = product.weight.detach().bfloat16()
        storage, panels = bfloat16_panels(rounded)
        product.kernel = SelectedKernel((NATIVE, NATIVE, PLAIN), rounded.float(), None, panels, storage)
    return llama


def _chunks(contexts):
    chunks, next_block = [], 1
    for context in contexts:
        blocks = -(-(context + 1) // BLOCK)
        chunks.append(SequenceChunk(list(range(next_block, next_block + blocks)), context, 1))
        next_block += blocks
    return chunks


def _caches(model, dtype):
    return random_caches(model.kv_spec, dtype, blocks=200)


def _step(model, embeds, contexts, caches, fused: bool, monkeypatch):
    return run_step(model, embeds, torch.tensor(contexts), _chunks(contexts), caches, fused, monkeypatch)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_weight_only_bfloat16_step_is_the_module_path_bit_for_bit(monkeypatch, qkv_bias):
    model = _weight_only_bf16(qkv_bias)
    contexts = [37, 5, 300, 64]
    embeds = torch.randn(len(contexts), 64, generator=torch.Generator().manual_seed(2))
    stepped_caches, module_caches = _caches(model, torch.float32), _caches(model, torch.float32)
    stepped, calls = _step(model, embeds, contexts, stepped_caches, True, monkeypatch)
    module, none = _step(model, embeds, contexts, module_caches, False, monkeypatch)
    assert (calls, none) == (1, 0)
    assert torch.equal(stepped, module)
    for (k1, v1), (k2, v2) in zip(stepped_caches, module_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_bfloat16_model_steps_natively_closer_to_float32_than_its_modules(monkeypatch):
    reference = _float_model(False)
    select_linear_kernels(reference, "plain")
    model = _float_model(False).to(torch.bfloat16)
    select_linear_kernels(model, "native")
    assert all(p.kernel.panels is not None and p.kernel.panels.dtype == torch.bfloat16
               for p in model.decoder_structure.products())
    contexts = [37, 120, 9]
    embeds = torch.randn(len(contexts), 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    caches = _caches(model, torch.bfloat16)
    float_caches = [tuple(c.float() for c in pair) for pair in caches]
    stepped_caches = [tuple(c.clone() for c in pair) for pair in caches]
    module_caches = [tuple(c.clone() for c in pair) for pair in caches]
    stepped, calls = _step(model, embeds, contexts, stepped_caches, True, monkeypatch)
    module, none = _step(model, embeds, contexts, module_caches, False, monkeypatch)
    exact, _ = _step(reference, embeds.float(), contexts, float_caches, False, monkeypatch)
    assert (calls, none) == (1, 0)
    assert stepped.dtype == module.dtype == torch.bfloat16
    step_error = (stepped.float() - exact).abs().max()
    module_error = (module.float() - exact).abs().max()
    # bfloat16 keeps 8 significand bits: outputs of order 1 differ by a few 2^-8.
    assert step_error <= module_error and step_error < 0.05, (step_error, module_error)
    slots = [chunk.block_ids[chunk.start // BLOCK] * BLOCK + chunk.start % BLOCK for chunk in _chunks(contexts)]
    for (k1, v1), (k2, v2), (k0, v0) in zip(stepped_caches, module_caches, caches):
        assert k1.dtype == torch.bfloat16
        untouched = torch.ones(k1.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(k1[untouched], k0[untouched]) and torch.equal(v1[untouched], v0[untouched])
        torch.testing.assert_close(k1[slots].float(), k2[slots].float(), rtol=0.05, atol=0.05)
        torch.testing.assert_close(v1[slots].float(), v2[slots].float(), rtol=0.05, atol=0.05)


def test_the_step_rounds_cache_writes_as_torch_does(monkeypatch):
    # The first layer's V rows depend on the embeddings alone (no rotary, no attention):
    # recomputed here with the same kernels in float32 and rounded by torch, they must be
    # what the step wrote into the bfloat16 cache.
    from vlmd.layers.cpu import elementwise
    from vlmd.layers.cpu.packed_linear import packed_linear

    model = _float_model(False).to(torch.bfloat16)
    select_linear_kernels(model, "native")
    structure, contexts = model.decoder_structure, [20, 41]
    caches = _caches(model, torch.bfloat16)
    embeds = torch.randn(2, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    _, calls = _step(model, embeds, contexts, caches, True, monkeypatch)
    assert calls == 1
    layer = structure.layers[0]
    normed = elementwise.add_rms_norm(embeds.float(), None, layer.input_norm.weight.float(), structure.eps)
    qkv = packed_linear(normed, layer.qkv.kernel.panels, None)
    assert qkv.dtype == torch.float32  # float32 rows: the output is not rounded
    v_start = (structure.heads + structure.kv_heads) * structure.head_dim
    for row, chunk in enumerate(_chunks(contexts)):
        slot = chunk.block_ids[chunk.start // BLOCK] * BLOCK + chunk.start % BLOCK
        expected = qkv[row, v_start:].bfloat16().view(structure.kv_heads, structure.head_dim)
        assert torch.equal(caches[0][1][slot], expected)
