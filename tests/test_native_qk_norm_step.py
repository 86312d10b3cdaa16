"""Qwen3's layer through the native decode step (``layers/cpu/decoder_step.c``): an RMSNorm
of each query and key head (``head_dim`` wide, its own weight for q and for k) between the
q/k/v product and rotary, run in the step by the kernel the module path runs
(``elementwise.head_rms_norm_``), so a float32 step equals the module path bit for bit; a
``--dtype bfloat16`` model's step agrees with its modules to bfloat16 rounding and is the
closer to float32; and Qwen3-VL's decoder is logged as taking the fused step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from structlog.testing import capture_logs
from transformers import Qwen3Config

from decode_step_support import decode_chunks, random_caches, run_step
from vlmd.layers.cpu import decoder_step, fused_step
from vlmd.layers.linear import select_linear_kernels
from vlmd.models.qwen3 import Qwen3ForCausalLM

pytestmark = [
    pytest.mark.skipif(not decoder_step.available(), reason="no kernel library was built in this install"),
    pytest.mark.usefixtures("each_kernel_variant"),
]


def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Products of small random weights; norm weights around 1, each head norm's distinct
    per column, so that a norm skipped or run with the other weight changes the result."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.08)
    return model.eval()


def _qwen3(head_dim: int, mode: str = "native", dtype=torch.float32) -> Qwen3ForCausalLM:
    config = Qwen3Config(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=head_dim, vocab_size=101, max_position_embeddings=4096,
                         rms_norm_eps=1e-6)
    model = _randomized(Qwen3ForCausalLM(config)).to(dtype)
    select_linear_kernels(model, mode)
    if mode == "native" and any(p.kernel.panels is None for p in model.decoder_structure.products()):
        # The step reads every product's panels: a host whose oneDNN packs these shapes in a
        # layout the kernel does not read has no native step.
        pytest.skip("oneDNN packs these weights in a layout the native kernel does not read on this host")
    return model


@pytest.mark.parametrize("head_dim", [32, 20])  # 20: a head that is not a whole number of vectors
@pytest.mark.parametrize("contexts,shared", [([37], 0), ([5, 300, 64, 17, 900], 0), ([70, 41, 99, 33], 2)])
def test_the_qk_norm_step_is_the_module_path_bit_for_bit(monkeypatch, head_dim, contexts, shared):
    model = _qwen3(head_dim)
    assert fused_step.unsupported(model.decoder_structure) is None
    chunks = decode_chunks(contexts, shared)
    embeds, positions = torch.randn(len(chunks), 64, generator=torch.Generator().manual_seed(2)), torch.tensor(contexts)
    stepped_caches, module_caches = random_caches(model.kv_spec), random_caches(model.kv_spec)
    stepped, calls = run_step(model, embeds, positions, chunks, stepped_caches, True, monkeypatch)
    module, none = run_step(model, embeds, positions, chunks, module_caches, False, monkeypatch)
    assert (calls, none) == (1, 0)  # the step did run natively, the other did not
    assert torch.equal(stepped, module)
    for (k1, v1), (k2, v2) in zip(stepped_caches, module_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch-ops"])
def test_the_head_norms_are_what_transformers_computes(monkeypatch, kernels):
    # The module path's in-place norm of each head (and the step, equal to it above) against
    # transformers' Qwen3 attention on the same weights: within float32 rounding; also where
    # the seams fall back to torch ops (rows the CPU kernels do not serve).
    from transformers.models.qwen3 import modeling_qwen3

    from vlmd.layers.cpu import elementwise

    if not kernels:
        monkeypatch.setattr(elementwise, "serves", lambda *tensors: False)
    model = _qwen3(32, mode="plain")
    attention = model.layers[0].self_attn
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    cos, sin = model.rotary.cos_sin(torch.arange(5), torch.float32)
    with torch.inference_mode():
        q, k, _ = attention.project_qkv(hidden, cos, sin)
        columns = attention.qkv_proj(hidden)
    reference = modeling_qwen3.Qwen3RMSNorm(32, eps=1e-6)
    reference.weight.data.copy_(attention.q_norm.weight)
    with torch.inference_mode():
        q_normed = reference(columns[:, :128].view(5, 4, 32))
        reference.weight.data.copy_(attention.k_norm.weight)
        k_normed = reference(columns[:, 128:192].view(5, 2, 32))
        q_ref, k_ref = modeling_qwen3.apply_rotary_pos_emb(q_normed, k_normed, cos[:, 0], sin[:, 0], unsqueeze_dim=1)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_qwen3_steps_natively_closer_to_float32_than_its_modules(monkeypatch):
    reference = _qwen3(32, mode="plain")
    model = _qwen3(32, dtype=torch.bfloat16)
    contexts = [37, 120, 9]
    chunks = decode_chunks(contexts)
    embeds = torch.randn(len(contexts), 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    positions = torch.tensor(contexts)
    caches = random_caches(model.kv_spec, torch.bfloat16)
    stepped_caches = [tuple(c.clone() for c in pair) for pair in caches]
    module_caches = [tuple(c.clone() for c in pair) for pair in caches]
    float_caches = [tuple(c.float() for c in pair) for pair in caches]
    stepped, calls = run_step(model, embeds, positions, chunks, stepped_caches, True, monkeypatch)
    module, none = run_step(model, embeds, positions, chunks, module_caches, False, monkeypatch)
    exact, _ = run_step(reference, embeds.float(), positions, chunks, float_caches, False, monkeypatch)
    assert (calls, none) == (1, 0)
    assert stepped.dtype == module.dtype == torch.bfloat16
    step_error = (stepped.float() - exact).abs().max()
    module_error = (module.float() - exact).abs().max()
    # bfloat16 keeps 8 significand bits: outputs of order 1 differ by a few 2^-8.
    assert step_error <= module_error and step_error < 0.05, (step_error, module_error)


def test_a_structure_has_its_norms_in_every_layer_or_none():
    structure = _qwen3(32, mode="plain").decoder_structure
    assert structure.query_key_norm and all(layer.query_norm is not None for layer in structure.layers)
    first, *rest = structure.layers
    stripped = dataclasses.replace(first, query_norm=None, key_norm=None)
    assert not dataclasses.replace(structure, layers=(stripped,)).query_key_norm
    with pytest.raises(ValueError, match="every layer of a decoder or in none"):
        dataclasses.replace(structure, layers=(stripped, *rest))
    with pytest.raises(ValueError, match="every layer of a decoder or in none"):
        dataclasses.replace(structure, layers=(dataclasses.replace(first, key_norm=None), *rest))


def test_qwen3_vl_decodes_through_the_fusedrun_step(monkeypatch):
    # Qwen3-VL's decoder (interleaved M-RoPE, DeepStack's additions at prefill only): the
    # start-up log names the fused step, and a decode step of [3, B] positions takes it,
    # bit for bit the modules'.
    from vlmd_qwen3_vl.model import Qwen3VLModel
    from vlmd_qwen3_vl.tiny import qwen3_vl_config

    names = ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    config = qwen3_vl_config("tiny", vocab_size=4096, ids={name: 4000 + i for i, name in enumerate(names)})
    model = _randomized(Qwen3VLModel(config))
    with capture_logs() as logs:
        select_linear_kernels(model, "native")
    structure = model.language_model.decoder_structure
    if any(p.kernel.panels is None for p in structure.products()):
        pytest.skip("oneDNN packs these weights in a layout the native kernel does not read on this host")
    logged = [entry for entry in logs if entry["event"] == "decode steps"]
    assert len(logged) == 1 and logged[0]["path"] == "fused", logged
    contexts = [40, 75]
    chunks = decode_chunks(contexts)
    embeds = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([[40, 75], [33, 60], [35, 61]])  # t, h, w rows: a decode after an image
    kv_spec = model.language_model.kv_spec
    stepped_caches, module_caches = random_caches(kv_spec), random_caches(kv_spec)
    stepped, calls = run_step(model, embeds, positions, chunks, stepped_caches, True, monkeypatch)
    module, none = run_step(model, embeds, positions, chunks, module_caches, False, monkeypatch)
    assert (calls, none) == (1, 0)
    assert torch.equal(stepped, module)
