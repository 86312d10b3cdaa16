"""Cross-attention K/V in the cross pool, the memory plan, the KV budget and ``vlmd cost``
(issue 32 item 2, docs/decisions.md D93).

A family declares the cross tokens one item adds to its request
(``BaseProcessingInfo.cross_kv_tokens_per_item``) and its cross-attention layers
(``KVSpec.num_cross_layers``); the declaration must match what a real request holds: its
cross table after its prefill ran through the tiny Whisper and the tiny Llama 3.2 Vision, and
the K/V read back through that table must be the ones the model prepared. The plan sizes the
pool for --max-num-seqs requests before the KV cache gets the rest.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import Server, image_data_url, random_image
from vlmd.engine.memory_plan import (
    GIB, MemoryPlan, cross_items_per_request, cross_pool_blocks, cross_tokens_per_request, kv_budget_bytes,
)
from vlmd.sched.block_pool import blocks_needed

BLOCK = 16


def _prefill(model_dir: Path, modality: str, count: int):
    """Run one request with ``count`` of the family's worst-case items through its prefill on
    the real scheduler and runner; return its info, the runner, the scheduler and the items'
    encoder outputs."""
    from transformers import AutoConfig, AutoTokenizer

    from vlmd.engine.builder import load_model
    from vlmd.engine.core import EngineCore
    from vlmd.plugins.manager import build_registry
    from vlmd.processing.base import ProcessingContext
    from vlmd.runner.model_runner import ModelRunner
    from vlmd.sched.scheduler import Scheduler, SchedulerConfig
    from vlmd.types import EngineRequest, SamplingParams

    hf_config = AutoConfig.from_pretrained(model_dir)
    family = build_registry().for_architectures(list(hf_config.architectures))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ctx = ProcessingContext(model_dir=str(model_dir), model_id="tiny", hf_config=hf_config, tokenizer=tokenizer,
                            mm_processor_kwargs={}, media_io_kwargs={})
    info = family.load("processing_info")(ctx)
    processor = family.load("processor")(info)
    dummy = family.load("dummy_inputs")(info)
    marker = info.marker_token_id(modality)
    filler = (tokenizer.encode(" the", add_special_tokens=False) or [0])[0]
    output = processor.apply([marker] * count + [filler], {modality: [dummy.dummy_item(modality)] * count})
    model = load_model(str(model_dir), torch.float32, None, hf_config, torch.device("cpu"))
    # Room for two such requests' cross tables, one block spare so the table is not the pool.
    cross_blocks = 2 * blocks_needed(count * info.cross_kv_tokens_per_item(modality), BLOCK) + 1
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, block_size=BLOCK,
                             num_kv_blocks=8, max_num_encoder_input_tokens=16384, encoder_cache_size=16384,
                             disable_chunked_mm_input=False, enable_prefix_caching=False, cross_kv_blocks=cross_blocks)
    runner = ModelRunner(model, config.num_kv_blocks, config.block_size, torch.float32, device=torch.device("cpu"),
                         cross_blocks=cross_blocks)
    scheduler = Scheduler(config)
    core = EngineCore(scheduler, runner)
    core.add_request(EngineRequest("r", list(output.prompt_token_ids), SamplingParams(max_tokens=3, ignore_eos=True),
                                   list(output.items), family_state=output.family_state))
    core.step()  # the prefill: the cross K/V are written into the request's blocks
    outputs = [runner.encoder_outputs[item.identifier] for item in output.items]
    return info, runner, scheduler, outputs, output.family_state


def _assert_read_back(runner, prepared, state) -> None:
    cross = runner.cross_cache.read(state.cross_block_ids, state.num_cross_tokens)
    assert len(cross.kv) == len(prepared)
    for (k, v), (k_ref, v_ref) in zip(cross.kv, prepared):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_whisper_holds_the_cross_blocks_it_declares(tiny_whisper_dir):
    info, runner, scheduler, outputs, _ = _prefill(tiny_whisper_dir, "audio", 1)
    state = runner.requests["r"]
    tokens = info.cross_kv_tokens_per_item("audio")
    assert state.num_cross_tokens == tokens == 1500
    assert len(state.cross_block_ids) == blocks_needed(tokens, BLOCK) == 94
    assert scheduler.kv.cross_stats()["used_blocks"] == 94
    assert runner.model.kv_spec == info.kv_spec() and info.kv_spec().num_cross_layers == 2
    # A block's bytes in every cross layer, as the plan counts it, are what the cache holds.
    per_block = info.kv_spec().cross_bytes_per_token(4) * BLOCK
    assert runner.cross_cache.nbytes == per_block * runner.cross_cache.num_blocks
    with torch.inference_mode():
        _assert_read_back(runner, runner.model.prepare_cross_attention(outputs[0]), state)
    assert cross_items_per_request(info.supported_mm_limits(), {}) == {"audio": 1}


def test_mllama_holds_the_cross_blocks_of_two_images(tiny_mllama_dir):
    info, runner, scheduler, outputs, layout = _prefill(tiny_mllama_dir, "image", 2)
    state = runner.requests["r"]
    tokens = 2 * info.cross_kv_tokens_per_item("image")
    assert state.num_cross_tokens == tokens > 0
    assert len(state.cross_block_ids) == blocks_needed(tokens, BLOCK)
    with torch.inference_mode():
        _assert_read_back(runner, runner.model.prepare_request_cross_attention(outputs, layout), state)
    # No limit of its own: the flag bounds it, else the pool counts one image a request.
    assert cross_items_per_request(info.supported_mm_limits(), {"image": 2}) == {"image": 2}
    assert cross_items_per_request(info.supported_mm_limits(), {}) == {"image": 1}
    assert cross_tokens_per_request(info, {"image": 2}) == tokens


def test_a_fragmented_table_is_gathered_and_reads_back_the_same():
    from vlmd.runner.cross_cache import CrossCache
    from vlmd.types import KVSpec

    cache = CrossCache(KVSpec(num_layers=1, num_kv_heads=2, head_dim=3, num_cross_layers=2), 6, 4, torch.float32)
    layers = [(torch.randn(2, 10, 3), torch.randn(2, 10, 3)) for _ in range(2)]
    for table in ([1, 2, 3], [5, 0, 3]):
        cache.write(table, 10, layers)
        cross = cache.read(table, 10, family_state="layout")
        assert cross.family_state == "layout"
        for (k, v), (k_ref, v_ref) in zip(cross.kv, layers):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    # A run is read in place: a view of the pool, no copy.
    view = cache.read([1, 2, 3], 10).kv[0][0]
    assert view.data_ptr() == cache.layers[0][0][:, 4:].data_ptr()
    with pytest.raises(RuntimeError, match="table of 2 blocks for 10 tokens"):
        cache.read([1, 2], 10)
    with pytest.raises(RuntimeError, match="K/V of 10 tokens for a request of 9"):
        cache.write([1, 2, 3], 9, layers)


def test_the_budget_pays_for_the_cross_pool():
    assert kv_budget_bytes(100 * GIB, 0.5, 10 * GIB, 5 * GIB, 1 * GIB, 4 * GIB) == 30 * GIB
    with pytest.raises(ValueError, match="--max-num-seqs or --limit-mm-per-prompt"):
        kv_budget_bytes(10 * GIB, 0.5, 1 * GIB, 1 * GIB, 0, 3 * GIB)
    plan = MemoryPlan("cpu", "kv-cache-gb", 0, 0.0, 1, 100, 10, 0, 5, 8192, 16, 1000, 2048,
                      cross_kv_blocks=7, cross_kv_bytes_per_block=3, max_num_seqs=3)
    fields = plan.fields()
    assert fields["cross_kv_bytes"] == 21
    assert fields["planned_bytes"] == 100 + 10 + 5 + 21 + 1000 * 8192
    assert cross_pool_blocks(1500, 16, 3) == 3 * 94 and cross_pool_blocks(0, 16, 3) == 0


def test_cost_shows_the_cross_pool(tiny_whisper_dir, tiny_mllama_dir):
    from vlmd.cost import CostOptions, audio_clip, compute_cost, format_table, parse_image

    whisper = compute_cost(str(tiny_whisper_dir), [audio_clip(10)], CostOptions(max_num_seqs=3))
    cross = whisper["cross_kv"]
    assert cross["request_blocks"] == 94 and cross["block_bytes"] == 2 * 2 * 64 * 16 * 4
    assert cross["request_bytes"] == cross["max_request_bytes"] == 94 * cross["block_bytes"]
    assert cross["num_blocks"] == 3 * 94 and cross["bytes"] == 3 * cross["max_request_bytes"]
    assert "--max-num-seqs 3 requests of 1 audio: 282 blocks" in format_table(whisper)

    options = CostOptions(max_num_seqs=4, limit_mm_per_prompt={"image": 2}, memory_gb=1.0, dtype="bfloat16")
    mllama = compute_cost(str(tiny_mllama_dir), [parse_image("100x60")], options)
    cross = mllama["cross_kv"]
    assert cross["items_per_request"] == {"image": 2}
    per_image = cross["request_tokens"]
    assert cross["max_request_bytes"] == blocks_needed(2 * per_image, 16) * cross["block_bytes"] > 0
    assert cross["bytes"] == 4 * cross["max_request_bytes"] == mllama["cache"]["cross_kv_bytes"]
    json.dumps(mllama)  # the --json report


def test_the_start_up_plan_logs_the_pool(whisper_server):
    """The session's tiny Whisper server (default --max-num-seqs): its "memory plan" line
    carries the cross pool, a window's cross K/V in float32 for every running request."""
    line = next(line for line in whisper_server.log_path.read_text().splitlines() if "memory plan" in line)
    # JSON in a log file (--log-format auto), key=value on a terminal.
    fields = json.loads(line) if line.lstrip().startswith("{") else dict(re.findall(r"(\w+)=(\S+)", line))
    assert int(fields["cross_kv_bytes_per_block"]) == 2 * 2 * 64 * 16 * 4  # layers x (K, V) x d_model x block x float32
    assert int(fields["cross_kv_blocks"]) == 94 * int(fields["max_num_seqs"]) == 94 * 256  # 1,500 frames a window
    assert int(fields["cross_kv_bytes"]) == int(fields["cross_kv_blocks"]) * int(fields["cross_kv_bytes_per_block"])
    assert int(fields["planned_bytes"]) >= int(fields["kv_bytes"]) + int(fields["cross_kv_bytes"])
    # And /metrics says the same, as a part of the plan, beside the pool's gauges.
    metrics = whisper_server.request("GET", "/metrics")[1].decode().splitlines()
    metric = next(line for line in metrics if line.startswith("vlmd_memory_plan_bytes{") and 'part="cross_kv"' in line)
    assert float(metric.split()[-1]) == int(fields["cross_kv_bytes"])
    total = next(line for line in metrics if line.startswith("vlmd_kv_cache_cross_total_blocks "))
    assert float(total.split()[-1]) == int(fields["cross_kv_blocks"])


def test_a_text_only_mllama_server_starts_and_serves_text(tiny_mllama_dir, tmp_path_factory):
    """--limit-mm-per-prompt image=0: text requests skip cross-attention, so the server starts
    (it refused to), holds no cross K/V, serves text and refuses an image with a 4xx."""
    server = Server(tiny_mllama_dir, "--limit-mm-per-prompt", "image=0", "--max-model-len", "256",
                    "--max-num-seqs", "4", log_dir=tmp_path_factory.mktemp("mllama-text-logs"))
    try:
        status, body = server.chat({"model": server.model, "max_tokens": 4, "temperature": 0,
                                    "messages": [{"role": "user", "content": "Write a poem."}]})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4
        image = {"type": "image_url", "image_url": {"url": image_data_url(random_image(1, 50, 40))}}
        status, body = server.chat({"model": server.model, "max_tokens": 4,
                                    "messages": [{"role": "user", "content": [image, {"type": "text", "text": "Hi"}]}]})
        assert 400 <= status < 500, body
        line = next(line for line in server.log_path.read_text().splitlines() if "memory plan" in line)
        assert '"cross_kv_blocks": 0' in line or "cross_kv_blocks=0" in line
    finally:
        server.stop()


def test_a_request_larger_than_the_cross_pool_is_refused_and_the_others_are_served(tiny_mllama_dir, tmp_path):
    """No --limit-mm-per-prompt: the pool holds --max-num-seqs requests of one image each (two
    here). Three images could never fit: a 400 at admission, not a request waiting forever;
    two images and one image are both answered (one waiting for the other's blocks if they
    meet), and every block is back in the pool afterwards."""
    server = Server(tiny_mllama_dir, "--max-num-seqs", "2", "--max-model-len", "256",
                    "--max-num-encoder-input-tokens", "65536", "--encoder-cache-size", "65536", log_dir=tmp_path)

    def chat(images: int):
        parts = [{"type": "image_url", "image_url": {"url": image_data_url(random_image(index, 50, 40))}}
                 for index in range(images)]
        return server.chat({"model": server.model, "max_tokens": 3, "temperature": 0,
                            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}]})

    try:
        total = server.metrics()["vlmd_kv_cache_cross_total_blocks"]
        per_image = total // 2
        status, body = chat(3)
        assert status == 400, body
        assert "cross-attention pool" in json.dumps(body)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(chat, (2, 1)))
        assert [status for status, _ in answers] == [200, 200], answers
        metrics = server.metrics()
        assert metrics["vlmd_kv_cache_cross_blocks"] == 0
        assert metrics["vlmd_kv_cache_cross_peak_request_blocks"] == pytest.approx(2 * per_image, abs=1)
    finally:
        server.stop()
