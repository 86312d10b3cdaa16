"""Cross-attention K/V in the one KV pool, the memory plan and ``vlmd cost`` (docs/decisions.md
D93, D95).

A family declares the cross tokens one item adds to its request
(``BaseProcessingInfo.cross_kv_tokens_per_item``) and its cross-attention layers
(``KVSpec.num_cross_layers``); the declaration must match what a real request holds: its
cross table after its prefill ran through the tiny Whisper and the tiny Llama 3.2 Vision, and
the K/V read back through that table must be the ones the model prepared. Their blocks come
from the same pool as every other group's, inside --kv-cache-gb.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import Server, image_data_url, random_image
from vlmd.engine.memory_plan import cross_items_per_request, cross_tokens_per_request
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
    # Room for two such requests' cross tables and text, one block spare so the table is not the pool.
    blocks = 2 * blocks_needed(count * info.cross_kv_tokens_per_item(modality), BLOCK) + 8 * 4 + 1
    kv_cache = model.kv_spec.kv_cache_config(BLOCK, 4, 64, 64, num_blocks=blocks)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, kv_cache=kv_cache,
                             max_num_encoder_input_tokens=16384, encoder_cache_size=16384,
                             disable_chunked_mm_input=False, enable_prefix_caching=False)
    runner = ModelRunner(model, kv_cache, torch.float32, device=torch.device("cpu"))
    scheduler = Scheduler(config)
    core = EngineCore(scheduler, runner)
    core.add_request(EngineRequest("r", list(output.prompt_token_ids), SamplingParams(max_tokens=3, ignore_eos=True),
                                   list(output.items), family_state=output.family_state))
    core.step()  # the prefill: the cross K/V are written into the request's blocks
    outputs = [runner.encoder_outputs[item.identifier] for item in output.items]
    return info, runner, scheduler, outputs, output.family_state


def _assert_read_back(runner, prepared, state) -> None:
    from vlmd.layers.attention import cross_kv

    cache = runner.cross_cache
    table = state.block_tables[cache.group]
    assert len(cache.layers) == len(prepared)
    for layer, (k_ref, v_ref) in zip(cache.layers, prepared):
        k, v = cross_kv(layer, table, state.num_cross_tokens, cache.block_size)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_whisper_holds_the_cross_blocks_it_declares(tiny_whisper_dir):
    info, runner, scheduler, outputs, _ = _prefill(tiny_whisper_dir, "audio", 1)
    state = runner.requests["r"]
    tokens = info.cross_kv_tokens_per_item("audio")
    assert state.num_cross_tokens == tokens == 1500
    cross_group = runner.cross_cache.group
    assert len(state.block_tables[cross_group]) == blocks_needed(tokens, BLOCK) == 94
    assert scheduler.kv.group_stats()[cross_group]["used_blocks"] == 94
    assert runner.model.kv_spec == info.kv_spec() and info.kv_spec().num_cross_layers == 2
    # A page holds a block of every layer slot: the two self-attention layers' or the two
    # cross-attention layers', whichever group holds it; the plan's page is what the cache holds.
    kv_cache = scheduler.config.kv_cache
    assert kv_cache.num_slots == 2 and len(runner.kv_slots) == 2
    slots_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_slots)
    assert slots_bytes == kv_cache.page_bytes * kv_cache.num_blocks
    spec = info.kv_spec()  # a page: every cross layer's K and V of a block, float32
    assert kv_cache.page_bytes == 2 * spec.num_cross_layers * spec.num_kv_heads * spec.head_dim * 4 * BLOCK
    with torch.inference_mode():
        _assert_read_back(runner, runner.model.prepare_cross_attention(outputs[0]), state)
    assert cross_items_per_request(info.supported_mm_limits(), {}) == {"audio": 1}


def test_mllama_holds_the_cross_blocks_of_two_images(tiny_mllama_dir):
    info, runner, scheduler, outputs, layout = _prefill(tiny_mllama_dir, "image", 2)
    state = runner.requests["r"]
    tokens = 2 * info.cross_kv_tokens_per_item("image")
    assert state.num_cross_tokens == tokens > 0
    assert len(state.block_tables[runner.cross_cache.group]) == blocks_needed(tokens, BLOCK)
    with torch.inference_mode():
        _assert_read_back(runner, runner.model.prepare_request_cross_attention(outputs, layout), state)
    # No limit of its own: the flag bounds it, else the pool counts one image a request.
    assert cross_items_per_request(info.supported_mm_limits(), {"image": 2}) == {"image": 2}
    assert cross_items_per_request(info.supported_mm_limits(), {}) == {"image": 1}
    assert cross_tokens_per_request(info, {"image": 2}) == tokens


def test_a_fragmented_table_is_gathered_and_reads_back_the_same():
    from vlmd.layers.attention import cross_kv
    from vlmd.runner.cross_cache import CrossCache

    slots = [(torch.zeros(6 * 4, 2, 3), torch.zeros(6 * 4, 2, 3)) for _ in range(2)]  # 6 blocks of 4
    cache = CrossCache(slots, 4, group=1)
    layers = [(torch.randn(2, 10, 3), torch.randn(2, 10, 3)) for _ in range(2)]
    for table in ([1, 2, 3], [5, 0, 3]):
        cache.write(table, 10, layers)
        for slot, (k_ref, v_ref) in zip(slots, layers):
            k, v = cross_kv(slot, table, 10, 4)
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    # A run is read in place: its rows hold the heads first, a contiguous [heads, tokens, dim]
    # view (each head's tokens contiguous, as attention reads them fastest), no copy.
    cache.write([1, 2, 3], 10, layers)
    view = cross_kv(slots[0], [1, 2, 3], 10, 4)[0]
    assert view.shape == (2, 10, 3) and view.is_contiguous() and view.data_ptr() == slots[0][0][4:].data_ptr()
    assert torch.equal(slots[0][0][4:14].flatten(), layers[0][0].flatten())
    with pytest.raises(RuntimeError, match="table of 2 blocks for 10 tokens"):
        cross_kv(slots[0], [1, 2], 10, 4)
    with pytest.raises(RuntimeError, match="K/V of 10 tokens for a request of 9"):
        cache.write([1, 2, 3], 9, layers)


def test_the_backend_attends_each_span_to_its_own_table():
    """``cross_attention`` (the backend's): per span its table's K/V, GQA, a mask, a gathered
    table, rows no span covers zero; equal to plain attention over each request's K/V."""
    import torch.nn.functional as F

    from vlmd.layers.attention import CrossSpan, attention_backend_for, cross_attention

    from vlmd.runner.cross_cache import CrossCache

    torch.manual_seed(0)
    block, heads, kv_heads, dim = 4, 6, 2, 8
    k_cache, v_cache = torch.randn(12 * block, kv_heads, dim), torch.randn(12 * block, kv_heads, dim)
    cache = CrossCache([(k_cache, v_cache)], block, group=1)
    backend = attention_backend_for("cpu", block, "torch")
    meta = backend.prepare_metadata([], 0)
    q = torch.randn(9, heads, dim)
    mask = torch.rand(3, 7) > 0.3
    mask[:, 0] = True  # every row sees something
    spans = [CrossSpan(0, 3, [2, 3], 7, mask), CrossSpan(4, 9, [9, 5, 1], 10)]  # a run, and a split table
    written = []
    for span in spans:  # each request's K/V as the model prepares them, written by the runner
        k, v = torch.randn(kv_heads, span.num_tokens, dim), torch.randn(kv_heads, span.num_tokens, dim)
        cache.write(span.table, span.num_tokens, [(k, v)])
        written.append((k, v))
    out = cross_attention(q, (k_cache, v_cache), meta, 0.3, spans)
    assert torch.equal(out[3], torch.zeros(heads, dim))
    for span, (k, v) in zip(spans, written):
        group = heads // kv_heads
        expected = F.scaled_dot_product_attention(q[span.first:span.end].transpose(0, 1),
                                                  k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
                                                  scale=0.3, attn_mask=span.mask).transpose(0, 1)
        torch.testing.assert_close(out[span.first:span.end], expected)


def test_cost_counts_cross_attention_in_the_pool(tiny_whisper_dir, tiny_mllama_dir):
    from vlmd.cost import CostOptions, audio_clip, compute_cost, format_table, parse_image

    whisper = compute_cost(str(tiny_whisper_dir), [audio_clip(10)], CostOptions(max_num_seqs=3, num_kv_blocks=1000))
    cross = whisper["cross_kv"]
    page = whisper["cache"]["block_bytes"]
    assert page == 2 * 2 * 64 * 16 * 4  # two layer slots x (K, V) x d_model x block x float32
    assert cross["request_blocks"] == 94 and cross["request_bytes"] == cross["max_request_bytes"] == 94 * page
    (request,) = [r for r in whisper["requests"] if r["request"] == "transcription window"]
    self_attention, cross_group = request["kv_groups"]
    assert (cross_group["kind"], cross_group["blocks"]) == ("cross_attention", 94)
    assert request["kv_blocks"] == self_attention["blocks"] + 94 and request["kv_bytes"] == request["kv_blocks"] * page
    assert whisper["cache"]["requests_held"] == 1000 // request["kv_blocks"]
    longest = blocks_needed(whisper["max_model_len"], 16)
    assert whisper["cache"]["max_concurrency"] == round(1000 / (longest + 94), 2)
    assert "from the same pool" in format_table(whisper)

    options = CostOptions(max_num_seqs=4, limit_mm_per_prompt={"image": 2}, memory_gb=1.0, dtype="bfloat16")
    mllama = compute_cost(str(tiny_mllama_dir), [parse_image("100x60")], options)
    cross = mllama["cross_kv"]
    assert cross["items_per_request"] == {"image": 2}
    per_image = cross["request_tokens"]
    assert cross["max_request_bytes"] == blocks_needed(2 * per_image, 16) * mllama["cache"]["block_bytes"] > 0
    assert "cross_kv_bytes" not in mllama["cache"]  # nothing reserved beside the pool
    json.dumps(mllama)  # the --json report


def test_the_start_up_plan_logs_the_groups(whisper_server):
    """The session's tiny Whisper server: its "memory plan" line carries the KV groups (self-
    and cross-attention, one pool), and /metrics the same figures."""
    line = next(line for line in whisper_server.log_path.read_text().splitlines() if "memory plan" in line)
    fields = json.loads(line)
    groups = fields["kv_groups"]
    assert [(group["kind"], group["layers"]) for group in groups] == \
        [("full_attention", [0, 1]), ("cross_attention", [2, 3])]
    assert groups[1]["full_length_request_blocks"] == 94  # 1,500 frames a window
    assert fields["kv_bytes_per_block"] == 2 * 2 * 64 * 16 * 4 and fields["kv_layer_slots"] == 2
    assert fields["kv_bytes"] == fields["num_kv_blocks"] * fields["kv_bytes_per_block"]
    longest = fields["max_model_len"]
    assert fields["max_full_length_requests"] == fields["num_kv_blocks"] // (blocks_needed(longest, 16) + 94)
    capacity = next(line for line in whisper_server.log_path.read_text().splitlines()
                    if f"maximum concurrency for {longest} tokens per request" in line)
    assert f"{fields['max_concurrency']}x" in capacity
    metrics = whisper_server.metrics()
    assert metrics["vlmd_memory_plan_kv_blocks"] == fields["num_kv_blocks"]
    assert metrics["vlmd_memory_plan_max_concurrency"] == fields["max_concurrency"]
    assert metrics['vlmd_kv_cache_group_blocks{group="1",kind="cross_attention",window=""}'] == 0


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
        assert server.metrics()['vlmd_kv_cache_group_peak_request_blocks{group="2",kind="cross_attention",window=""}'] == 0
    finally:
        server.stop()


def test_a_request_larger_than_the_pool_is_refused_and_the_others_are_served(tiny_mllama_dir, tmp_path):
    """A pool of 16 blocks (the tiny model's three self-attention layers make two groups, each
    holding up to 4 blocks for a 64-token request): seven images' cross-attention K/V and
    their text could never fit, a 400 at admission, not a request waiting forever; two images and one image are both answered (one waiting for the
    other's blocks if they meet), and every block is back in the pool afterwards."""
    vision = json.loads((tiny_mllama_dir / "config.json").read_text())["vision_config"]
    per_image = vision["max_num_tiles"] * ((vision["image_size"] // vision["patch_size"]) ** 2 + 1)
    server = Server(tiny_mllama_dir, "--max-num-seqs", "2", "--max-model-len", "64", "--num-kv-blocks", "16",
                    "--max-num-encoder-input-tokens", "65536", "--encoder-cache-size", "65536", log_dir=tmp_path)

    def chat(images: int):
        parts = [{"type": "image_url", "image_url": {"url": image_data_url(random_image(index, 50, 40))}}
                 for index in range(images)]
        return server.chat({"model": server.model, "max_tokens": 3, "temperature": 0,
                            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}]})

    cross = '{group="2",kind="cross_attention",window=""}'
    try:
        assert blocks_needed(7 * per_image, BLOCK) + 2 * 2 > 16 >= blocks_needed(2 * per_image, BLOCK) + 2 * 2
        status, body = chat(7)
        assert status == 400, body
        assert "more than the server's whole KV cache of 16 blocks" in json.dumps(body)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(chat, (2, 1)))
        assert [status for status, _ in answers] == [200, 200], answers
        metrics = server.metrics()
        assert metrics["vlmd_kv_cache_group_blocks" + cross] == 0
        assert metrics["vlmd_kv_cache_free_blocks"] == 16
        assert metrics["vlmd_kv_cache_group_peak_request_blocks" + cross] == blocks_needed(2 * per_image, BLOCK)
    finally:
        server.stop()
