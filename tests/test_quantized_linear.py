"""Weight-only int8 (``--quantization int8``): the int8 panel reader
(``layers/cpu/quantized_linear.c``) against a float64 product of the dequantized weight,
the quantization itself, the native decode step against the module path (bit for bit:
the same kernels in the same order), the LM head's int8 product (tied to the embeddings
or not, and which families get one), the accuracy bound of docs/decisions.md against the
float32 model on the tiny and small LLaVA checkpoints, the bytes it keeps, and the flag.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from conftest import Server, image_message, random_image
from vlmd.layers.cpu import decoder_step
from vlmd.layers.cpu import packed_linear as native_linear
from vlmd.layers.cpu.fused_step import FusedDecodeSteps
from vlmd.layers.cpu.packed_linear import packed_linear
from vlmd.layers.cpu.panel_packing import INT8_MAX, dequantized, int8_panels
from vlmd.engine.sizing import weight_bytes_of
from vlmd.layers.cpu.panel_packing import int8_bytes
from vlmd.layers.linear import select_linear_kernels
from vlmd.layers.linear.quantize import int8_savings, logits_heads, quantizable_layers, quantize_decoder
from vlmd.models.llama import LlamaForCausalLM

needs_kernel = pytest.mark.skipif(not native_linear.available(), reason="no kernel library was built in this install")

# The accuracy bound (docs/decisions.md, weight-only int8), teacher-forced on the float32
# model's greedy tokens over STEPS steps after a 40-token prompt.
STEPS = 24
MIN_TOP1_AGREEMENT = 0.9
MAX_CHOSEN_LOGPROB_DELTA = 0.1  # nats: the log-probability of float32's choice
MAX_LOGPROB_DELTA = 0.25  # nats: any token's


@needs_kernel
@pytest.mark.usefixtures("each_kernel_variant")
@pytest.mark.parametrize("out_features,in_features", [(1000, 100), (33, 17), (130, 1000), (64, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_products_match_the_dequantized_reference(out_features, in_features, threads):
    torch.manual_seed(out_features + in_features)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    storage, panels = int8_panels(weight)
    plain = dequantized(storage, panels)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 5, 6, 7, 13, 40):
            x = torch.randn(rows, in_features)
            for with_bias in (None, bias):
                got = packed_linear(x, panels, with_bias)
                reference = F.linear(x.double(), plain.double(), None if with_bias is None else with_bias.double())
                assert got.dtype == torch.float32 and got.shape == (rows, out_features)
                torch.testing.assert_close(got.double(), reference, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(previous)


@needs_kernel
def test_quantization_is_per_output_channel_and_symmetric():
    weight = torch.randn(70, 50)
    weight[3] = 0.0  # a row of zeros stays zeros (scale 0, no division by it)
    weight[5] *= 1000.0  # one channel's range does not coarsen the others'
    storage, panels = int8_panels(weight)
    q, scales = storage
    assert q.dtype == torch.int8 and int(q.abs().max()) <= INT8_MAX
    torch.testing.assert_close(scales, weight.abs().amax(dim=1) / INT8_MAX)
    plain = dequantized(storage, panels)
    assert torch.equal(plain[3], torch.zeros(50))
    # Rounding to nearest: every weight within half a step of its channel's scale.
    assert bool(((plain - weight).abs() <= scales[:, None] / 2 * (1 + 1e-6)).all())
    assert torch.equal(dequantized(int8_panels(-weight)[0], panels), -plain)
    with pytest.raises(ValueError, match="NaN or infinite"):
        int8_panels(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="float32"):
        int8_panels(weight.bfloat16())


def _llama(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=101, max_position_embeddings=4096,
                         tie_word_embeddings=tied)
    llama = LlamaForCausalLM(config, qkv_bias=True).eval()
    with torch.no_grad():
        for param in llama.parameters():
            param.normal_(0, 0.08)
    return llama


@pytest.mark.skipif(not decoder_step.available(), reason="no kernel library was built in this install")
@pytest.mark.usefixtures("each_kernel_variant")
def test_the_int8_step_is_the_module_path_bit_for_bit(monkeypatch):
    from vlmd.layers.attention import SequenceChunk, attention_backend_for

    model = _llama()
    float_bytes = sum(p.weight.numel() * 4 for p in model.decoder_structure.products())
    select_linear_kernels(model, "plain", quantization="int8")
    products = model.decoder_structure.products()
    # No float copy is kept: the int8 panels and their scales are the layers' only weights.
    assert all(p.weight is None and p.kernel.weight is None and p.kernel.packed is None for p in products)
    assert model.lm_head.weight is None and model.lm_head.kernel.panels.dtype == torch.int8
    kept = sum(b.numel() * b.element_size() for p in products for b in p.buffers())
    assert kept == sum(-(-p.output_size // p.kernel.panels.panel_width) * p.kernel.panels.panel_width
                       * p.input_size + 4 * p.output_size for p in products)
    assert kept < float_bytes / 3
    contexts = [37, 300, 64, 5]
    chunks, block = [], 1
    for context in contexts:
        count = -(-(context + 1) // 16)
        chunks.append(SequenceChunk(list(range(block, block + count)), context, 1))
        block += count
    embeds = torch.randn(len(contexts), 64, generator=torch.Generator().manual_seed(1))
    outputs, caches, calls = [], [], []
    real = decoder_step.NativeDecoder.__call__
    monkeypatch.setattr(decoder_step.NativeDecoder, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(FusedDecodeSteps, "run", lambda *a: None)
        generator = torch.Generator().manual_seed(2)
        cache = [(torch.randn(100 * 16, 2, 16, generator=generator), torch.randn(100 * 16, 2, 16, generator=generator))
                 for _ in range(3)]
        backend = attention_backend_for("cpu", 16, "auto")
        with torch.inference_mode():
            outputs.append(model(embeds, torch.tensor(contexts), backend.prepare_metadata(chunks, 4), cache))
        caches.append(cache)
    assert len(calls) == 1
    assert torch.equal(outputs[0], outputs[1])
    for (k1, v1), (k2, v2) in zip(*caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@needs_kernel
@pytest.mark.parametrize("tied", [False, True])
def test_the_lm_head_is_an_int8_product_and_the_embeddings_stay_float(tied):
    model = _llama(tied)
    embedding = model.embed_tokens.weight
    float_head = model.lm_head.weight.detach().clone()
    float_embedding = embedding.detach().clone()
    float_bytes = weight_bytes_of(model)
    predicted = int8_savings(model, 4)  # what `vlmd cost` subtracts
    select_linear_kernels(model, "plain", quantization="int8")
    head = model.lm_head
    assert quantizable_layers(model)[-1] is head and logits_heads(model) == [head]
    # The head's product reads int8 panels alone; the lookup keeps the float weight, tied or not.
    assert head.weight is None and head.kernel.weight is None and head.kernel.packed is None
    assert head.kernel.panels.dtype == torch.int8 and {name for name, _ in head.named_buffers()} == {
        "weight_int8", "weight_scales"}
    assert model.embed_tokens.weight is embedding and torch.equal(embedding, float_embedding)
    ids = torch.tensor([0, 7, 100])
    assert torch.equal(model.embed_input_ids(ids), float_embedding[ids])
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    head_storage = (head.weight_int8, head.weight_scales)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits, F.linear(hidden, dequantized(head_storage, head.kernel.panels)),
                               rtol=1e-5, atol=1e-5)
    assert (logits - F.linear(hidden, float_head)).abs().max() < 0.05  # int8 rounding, not another product
    # The bytes: a tied head adds its int8 copy to the float weight the embeddings keep.
    head_int8 = int8_bytes(101, 64)
    products = model.decoder_structure.products()
    products_saved = sum(p.input_size * p.output_size * 4 - int8_bytes(p.output_size, p.input_size) for p in products)
    head_saved = -head_int8 if tied else 101 * 64 * 4 - head_int8
    assert float_bytes - weight_bytes_of(model) == products_saved + head_saved == predicted


@needs_kernel
@pytest.mark.parametrize("family", ["tiny_llava_dir", "tiny_qwen2_vl_dir", "tiny_qwen3_vl_dir", "tiny_internvl_dir",
                                    "tiny_gemma3_dir", "tiny_mllama_dir", "tiny_whisper_dir"])
def test_families_on_vlmds_llama_decoder_get_an_int8_head(family, request):
    """Llama (LLaVA), Qwen2 (Qwen2-VL, InternVL), Qwen3 (Qwen3-VL) and Gemma 3 decoders
    name their head; Llama 3.2 Vision and Whisper describe no decoder, so int8 is refused
    for them as before."""
    from vlmd.engine.builder import load_model

    model_dir = str(request.getfixturevalue(family))
    if family in ("tiny_mllama_dir", "tiny_whisper_dir"):
        with pytest.raises(ValueError, match="describes no decoder"):
            load_model(model_dir, torch.float32, linear_kernels="plain", quantization="int8")
        return
    lm = load_model(model_dir, torch.float32, linear_kernels="plain", quantization="int8").language_model
    assert logits_heads(lm) == [lm.lm_head] and lm.lm_head.kernel.panels.dtype == torch.int8
    assert lm.embed_tokens.weight.dtype == torch.float32


def test_a_decoder_with_experts_keeps_refusing_int8():
    from transformers import Qwen3MoeConfig

    from vlmd.models.qwen3_moe import Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=50, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=128)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    assert logits_heads(model) == [] and quantizable_layers(model) == []


def test_what_cannot_be_quantized_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        quantize_decoder(_llama(), "int4")
    assert quantize_decoder(_llama(), "none") == []
    if native_linear.available():
        with pytest.raises(ValueError, match="float32 CPU weights"):
            quantize_decoder(_llama().to(torch.bfloat16), "int8")
        with pytest.raises(ValueError, match="describes no decoder"):
            quantize_decoder(torch.nn.Sequential(torch.nn.Linear(4, 4)), "int8")


def test_an_unsupported_quantization_is_a_clean_cli_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "vlmd", "serve", str(tmp_path), "--quantization", "int4"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--quantization: invalid choice: 'int4'" in result.stderr and "Traceback" not in result.stderr


def test_int8_with_bfloat16_is_refused_before_loading(tiny_llava_dir):
    from vlmd.config import ServeConfig
    from vlmd.engine.builder import build_engine

    with pytest.raises(ValueError, match="--quantization int8 needs --dtype float32"):
        build_engine(ServeConfig(model=str(tiny_llava_dir), dtype="bfloat16", quantization="int8"))


def test_the_memory_plan_and_vlmd_cost_count_int8_bytes(tiny_llava_dir):
    from transformers import AutoConfig

    from vlmd.cost import weight_bytes
    from vlmd.engine.builder import load_model

    if not native_linear.available():
        pytest.skip("no kernel library was built in this install")
    float32 = load_model(str(tiny_llava_dir), torch.float32, linear_kernels="plain")
    quantized = load_model(str(tiny_llava_dir), torch.float32, linear_kernels="plain", quantization="int8")
    lm = quantized.language_model
    head = lm.lm_head  # untied in this checkpoint: its float weight goes
    assert head.weight is None and head.kernel.panels.dtype == torch.int8
    assert lm.embed_tokens.weight.dtype == torch.float32
    layers = [*lm.decoder_structure.products(), head]
    kept = sum(b.numel() * b.element_size() for layer in layers for b in layer.buffers())
    assert kept == sum(int8_bytes(layer.output_size, layer.input_size) for layer in layers)
    saved = sum(layer.input_size * layer.output_size * 4 for layer in layers) - kept
    assert saved > 0
    assert weight_bytes_of(float32) - weight_bytes_of(quantized) == saved  # what the start-up plan counts
    config = AutoConfig.from_pretrained(tiny_llava_dir)
    assert weight_bytes(str(tiny_llava_dir), config, "float32") - weight_bytes(
        str(tiny_llava_dir), config, "float32", "int8") == saved  # what `vlmd cost` counts
    # What contrib/bench/bench_quantized_decode.py reports a step reads: every product and
    # the head as stored (int8 here; the float32 model's head at 4 bytes a weight).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "contrib" / "bench"))
    from bench_quantized_decode import step_bytes

    assert step_bytes(quantized) == kept
    assert step_bytes(float32) == sum(layer.input_size * layer.output_size * 4 for layer in layers)


def _accuracy(model_dir, steps: int = STEPS) -> dict:
    """Teacher-forced agreement of the int8 model with the float32 one, and how many of
    the int8 model's decode steps took the native step. One thread: the figures do not
    depend on it, and a second OpenMP thread on a loaded CI host only slows the steps."""
    from vlmd.engine.builder import load_model
    from vlmd.testing.greedy_steps import agreement, greedy_steps, language_model

    rng = random.Random(0)
    prompt = [rng.randrange(3, 1000) for _ in range(40)]
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # The reference's kernels are not timed ("packed"): its products agree with any
        # other float32 kernel's to float32 rounding.
        reference = greedy_steps(load_model(str(model_dir), torch.float32, linear_kernels="packed"), prompt, steps)
        quantized = load_model(str(model_dir), torch.float32, quantization="int8")
        assert language_model(quantized).lm_head.kernel.panels.dtype == torch.int8  # the bound covers the head
        measured = agreement(reference, greedy_steps(quantized, prompt, steps, teacher=reference.tokens))
        measured["fused_steps"] = greedy_steps(quantized, prompt, 2).decode_paths["fused"]
    finally:
        torch.set_num_threads(previous)
    return measured


def _assert_within_bound(measured: dict) -> None:
    assert measured["top1_agreement"] >= MIN_TOP1_AGREEMENT, measured
    assert measured["max_chosen_logprob_delta"] <= MAX_CHOSEN_LOGPROB_DELTA, measured
    assert measured["max_logprob_delta"] <= MAX_LOGPROB_DELTA, measured


@needs_kernel
def test_int8_accuracy_on_the_tiny_llava(tiny_llava_dir):
    measured = _accuracy(tiny_llava_dir)
    _assert_within_bound(measured)
    assert measured["fused_steps"] == 2  # its decode steps took the native step


@needs_kernel
def test_int8_accuracy_on_the_small_llava(tmp_path_factory):
    from vlmd.testing.tiny import build_tiny

    # Fewer steps than the tiny's: each reads ~0.4 GB of float32 weights (CI time).
    small = build_tiny("llava", tmp_path_factory.mktemp("small-llava"), seed=0, size="small")
    _assert_within_bound(_accuracy(small, steps=12))


@needs_kernel
def test_an_int8_server_answers_and_decodes_natively(tiny_llava_dir, tmp_path):
    server = Server(tiny_llava_dir, "--quantization", "int8", "--no-warmup", log_dir=tmp_path)
    try:
        status, body = server.chat({"messages": image_message("Describe it.", random_image(7)), "max_tokens": 6,
                                    "ignore_eos": True, "temperature": 0})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 6
        metrics = server.metrics()
        assert metrics['vlmd_decode_steps_total{path="fused"}'] == 5
        assert metrics['vlmd_decode_steps_total{path="modules"}'] == 0
    finally:
        server.stop()
