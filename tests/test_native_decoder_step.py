"""A decode step through every layer in one native call (``layers/cpu/decoder_step.c``)
against the module path: the same kernels in the same order, so the final hidden states
and every layer's cache must be bit-identical; and the steps it must leave to the module
path (prefill rows, torch attention, products that are not the native kernel's)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from decode_step_support import BLOCK, decode_chunks, random_caches
from vlmd.layers.attention import SequenceChunk, attention_backend_for
from vlmd.layers.linear import select_linear_kernels
from vlmd.layers.linear.kernels import SelectedKernel
from vlmd.layers.cpu import decoder_step
from vlmd.layers.cpu.decoder_step import LayerTables
from vlmd.layers.cpu.fused_step import FusedDecodeSteps
from vlmd.models.llama import LlamaForCausalLM

pytestmark = [
    pytest.mark.skipif(not decoder_step.available(), reason="no kernel library was built in this install"),
    pytest.mark.usefixtures("each_kernel_variant"),
]


def _model(qkv_bias: bool, mode: str = "native") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=101, max_position_embeddings=4096)
    llama = LlamaForCausalLM(config, qkv_bias=qkv_bias).eval()
    with torch.no_grad():
        for param in llama.parameters():
            param.normal_(0, 0.08)
    select_linear_kernels(llama, mode)
    if mode == "native" and any(m.kernel.panels is None for m in llama.modules() if hasattr(m, "kernel")):
        # The step reads every product's panels: a host whose oneDNN packs these shapes in a
        # layout the kernel does not read (the layout check refused it) has no native step.
        pytest.skip("oneDNN packs these weights in a layout the native kernel does not read on this host")
    return llama


def _caches(model, seed):
    return random_caches(model.kv_spec, seed=seed)


def _both(model, chunks, embeds, positions, num_decodes, kernels="auto", monkeypatch=None):
    """(fused-or-not output, its caches, module output, its caches, native calls)."""
    calls = []
    real = decoder_step.NativeDecoder.__call__
    monkeypatch.setattr(decoder_step.NativeDecoder, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    backend = attention_backend_for("cpu", BLOCK, kernels)
    with torch.inference_mode():
        stepped_cache = _caches(model, 1)
        stepped = model(embeds, positions, backend.prepare_metadata(chunks, num_decodes), stepped_cache)
        monkeypatch.setattr(FusedDecodeSteps, "run", lambda *a: None)
        module_cache = _caches(model, 1)
        module = model(embeds, positions, backend.prepare_metadata(chunks, num_decodes), module_cache)
    return stepped, stepped_cache, module, module_cache, len(calls)


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("contexts,shared", [([37], 0), ([5, 300, 64, 17, 900], 0), ([70, 41, 99, 33], 2)])
def test_the_native_step_is_the_module_path_bit_for_bit(monkeypatch, qkv_bias, contexts, shared):
    model = _model(qkv_bias)
    chunks = decode_chunks(contexts, shared)
    torch.manual_seed(1)
    embeds, positions = torch.randn(len(chunks), 64), torch.tensor(contexts)
    stepped, stepped_cache, module, module_cache, calls = _both(model, chunks, embeds, positions, len(chunks),
                                                                monkeypatch=monkeypatch)
    assert calls == 1  # the step did run natively
    assert torch.equal(stepped, module)
    for (k1, v1), (k2, v2) in zip(stepped_cache, module_cache):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_steps_with_prefill_rows_or_torch_attention_keep_the_module_path(monkeypatch):
    model = _model(False)
    prompt = SequenceChunk([200, 201], 0, 20)
    chunks = decode_chunks([40, 50]) + [prompt]
    embeds, positions = torch.randn(22, 64), torch.tensor([40, 50] + list(range(20)))
    *_, calls = _both(model, chunks, embeds, positions, 2, monkeypatch=monkeypatch)
    assert calls == 0
    decodes = decode_chunks([40, 50])
    *_, calls = _both(model, decodes, embeds[:2], positions[:2], 2, kernels="torch", monkeypatch=monkeypatch)
    assert calls == 0


def test_products_that_are_not_the_native_kernel_keep_the_module_path(monkeypatch):
    model = _model(False, mode="packed")  # oneDNN's packed kernel: no panels for vlmd's
    chunks = decode_chunks([40, 50])
    *_, calls = _both(model, chunks, torch.randn(2, 64), torch.tensor([40, 50]), 2, monkeypatch=monkeypatch)
    assert calls == 0


def test_a_slot_outside_the_cache_raises_instead_of_writing_there():
    model = _model(False)
    chunks = decode_chunks([40])
    caches = _caches(model, 1)
    backend = attention_backend_for("cpu", BLOCK, "auto")
    meta = backend.prepare_metadata(chunks, 1)
    decoder, _ = FusedDecodeSteps().decoder(model.decoder_structure, caches)
    assert decoder is not None
    cos, sin = model.rotary.cos_sin(torch.tensor([40]), torch.float32)
    with pytest.raises(ValueError, match="slot outside the cache"):
        decoder(torch.randn(1, 64), cos[:, 0], sin[:, 0],
                [LayerTables(torch.tensor([400 * BLOCK]), meta.decode_tables)] * len(caches))


def test_inputs_the_kernel_does_not_read_keep_the_module_path(monkeypatch):
    model = _model(False)
    chunks = decode_chunks([40, 50])
    wide = torch.randn(2, 128)[:, ::2]  # rows that are not contiguous
    stepped, _, module, _, calls = _both(model, chunks, wide, torch.tensor([40, 50]), 2, monkeypatch=monkeypatch)
    assert calls == 0 and torch.equal(stepped, module)


def test_a_batch_past_the_native_buckets_keeps_the_module_path(monkeypatch):
    # Products of more than 32 rows are oneDNN's in "native" mode: the panels exist, but
    # the choice at that row count is not vlmd's kernel.
    model = _model(False)
    contexts = [20 + i for i in range(40)]
    chunks = decode_chunks(contexts)
    *_, calls = _both(model, chunks, torch.randn(40, 64), torch.tensor(contexts), 40, monkeypatch=monkeypatch)
    assert calls == 0


def test_new_kernels_rebuild_the_step(monkeypatch):
    model = _model(False)
    caches = _caches(model, 1)
    steps = FusedDecodeSteps()
    first, _ = steps.decoder(model.decoder_structure, caches)
    assert steps.decoder(model.decoder_structure, caches)[0] is first  # kept while nothing changed
    # A product given another kernel (in general another packed weight): the step must not
    # keep reading the old one's address.
    down = model.layers[1].mlp.down_proj
    old = down.kernel
    down.kernel = SelectedKernel(old.choices, old.weight, old.packed, old.panels)
    rebuilt, kernels = steps.decoder(model.decoder_structure, caches)
    assert rebuilt is not first and down.kernel in kernels
