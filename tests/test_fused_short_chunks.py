"""Short prefill chunks (a prompt's last tokens past its cached blocks) run in the fused decode
step as decodes (``AttentionBackend.short_chunks_as_decodes``): the same hidden states as the
modules' prefill, the K/V in the cache the same, only the sampled rows returned where the
runner asks for them, and the chunks that cannot go (too long, a sequence's first tokens,
bidirectional spans) left to the modules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig

from decode_step_support import BLOCK, decode_chunks, random_caches
from vlmd.layers.attention import SequenceChunk, attention_backend_for
from vlmd.layers.attention import backend as attention_backend
from vlmd.layers.cpu import decoder_step
from vlmd.layers.cpu.fused_step import FusedDecodeSteps
from vlmd.layers.linear import select_linear_kernels
from vlmd.models.llama import LlamaForCausalLM

pytestmark = [
    pytest.mark.skipif(not decoder_step.available(), reason="no kernel library was built in this install"),
    pytest.mark.usefixtures("each_kernel_variant"),
]


def _llama(dtype=torch.float32) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=101, max_position_embeddings=4096, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.3 * torch.randn_like(param) if name.endswith("norm.weight") else 0.08 * torch.randn_like(param))
    model = model.eval().to(dtype)
    select_linear_kernels(model, "native")
    if any(p.kernel.panels is None for p in model.decoder_structure.products()):
        pytest.skip("oneDNN packs these weights in a layout the native kernel does not read on this host")
    return model


def _step(model, chunks, num_decodes, caches, fused: bool, outputs_of=None):
    """One step of ``chunks`` (the first ``num_decodes`` decodes) on copies of ``caches``:
    (hidden, caches after, native step calls, the backend's decode_steps)."""
    caches = [(k.clone(), v.clone()) for k, v in caches]
    backend = attention_backend_for("cpu", BLOCK, "auto")
    if not fused:
        backend.FUSES_SHORT_CHUNKS = False
    rows = sum(chunk.count for chunk in chunks)
    embeds = torch.randn(rows, 64, generator=torch.Generator().manual_seed(5)).to(caches[0][0].dtype)
    positions = torch.tensor([chunk.start + i for chunk in chunks for i in range(chunk.count)])
    meta = backend.prepare_metadata(chunks, num_decodes)
    outputs = None
    if outputs_of is not None:
        row_ends, at = [], 0
        for chunk in chunks:
            at += chunk.count
            row_ends.append((at - 1, chunk))
        outputs = backend.prepare_output_rows([row_ends[i] for i in outputs_of], rows)
    calls = []
    real = decoder_step.NativeDecoder.__call__
    decoder_step.NativeDecoder.__call__ = lambda self, *a: calls.append(1) or real(self, *a)
    try:
        with torch.inference_mode():
            hidden = model(embeds, positions, meta, caches, outputs)
    finally:
        decoder_step.NativeDecoder.__call__ = real
    return hidden, caches, len(calls), dict(backend.decode_steps)


def _chunks():
    """Two decodes, then a 16-token chunk after 40 cached tokens and a 5-token one after 17."""
    decodes = decode_chunks([33, 70], seed=1)
    tables = decode_chunks([40 + 16, 17 + 5], seed=2, blocks=400)
    used = {b for chunk in decodes for b in chunk.block_ids}
    tables = [SequenceChunk([b for b in chunk.block_ids if b not in used] or chunk.block_ids, 0, 1) for chunk in tables]
    return decodes + [SequenceChunk(tables[0].block_ids, 40, 16), SequenceChunk(tables[1].block_ids, 17, 5)]


def test_short_chunks_run_fused_as_the_modules_prefill_them():
    model = _llama()
    caches = random_caches(model.kv_spec, seed=3)
    chunks = _chunks()
    fused, fused_caches, calls, steps = _step(model, chunks, 2, caches, fused=True)
    modules, module_caches, module_calls, _ = _step(model, chunks, 2, caches, fused=False)
    assert calls == 1 and module_calls == 0 and steps["fused_chunks"] == 1
    torch.testing.assert_close(fused, modules, rtol=1e-5, atol=1e-5)
    for (k, v), (mk, mv) in zip(fused_caches, module_caches):  # the rows' K/V written as the modules write them
        torch.testing.assert_close(k, mk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, mv, rtol=1e-5, atol=1e-5)


def test_only_the_sampled_rows_come_back_where_the_runner_asks():
    model = _llama()
    caches = random_caches(model.kv_spec, seed=4)
    chunks = _chunks()
    fused, _, calls, _ = _step(model, chunks, 2, caches, fused=True, outputs_of=[0, 1, 3])
    modules, _, module_calls, _ = _step(model, chunks, 2, caches, fused=False, outputs_of=[0, 1, 3])
    assert calls == 1 and module_calls == 0 and fused.shape == (3, 64)
    torch.testing.assert_close(fused, modules, rtol=1e-5, atol=1e-5)


def test_bfloat16_short_chunks_agree_with_the_modules_to_bfloat16_rounding():
    model = _llama(torch.bfloat16)
    caches = random_caches(model.kv_spec, dtype=torch.bfloat16, seed=6)
    chunks = _chunks()
    fused, _, calls, _ = _step(model, chunks, 2, caches, fused=True)
    modules, _, _, _ = _step(model, chunks, 2, caches, fused=False)
    assert calls == 1
    torch.testing.assert_close(fused.float(), modules.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("chunk", [
    SequenceChunk(list(range(1, 8)), 40, attention_backend.FUSED_CHUNK_TOKENS + 1),  # too long
    SequenceChunk(list(range(1, 8)), 0, 5),                                          # a sequence's first tokens
    SequenceChunk(list(range(1, 8)), 40, 6, spans=((40, 46),)),                       # both ways
])
def test_chunks_that_cannot_go_leave_the_step_to_the_modules(chunk):
    model = _llama()
    caches = random_caches(model.kv_spec, seed=7)
    decodes = decode_chunks([33], seed=1, blocks=400)
    chunk = dataclasses.replace(chunk, block_ids=[b + 100 for b in chunk.block_ids])
    _, _, calls, steps = _step(model, [*decodes, chunk], 1, caches, fused=True)
    assert calls == 0 and steps == {"fused": 0, "modules": 0, "fused_chunks": 0}
