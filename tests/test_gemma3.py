"""Gemma 3 through the real server: greedy tokens equal transformers' generate.

The tiny checkpoint has a 24-token sliding window on every other layer, so every prompt
here runs past it, and images whose tokens attend to each other both ways. Cases: one
image; two images of different sizes (the wide one cut into pan-and-scan crops); text
only; a tall image with crops; a wide image with pan-and-scan turned off by the request;
a prompt several windows long with an image at its start. Each runs alone, then all
concurrently; then a second turn (``cached_tokens``). A second server, with tensor
parallelism over 2 ranks, a token budget of 24 (each image's 16 tokens kept whole in one
step while text chunks around it) and a KV cache small enough to preempt, runs the cases
its settings allow, concurrently. The first server's steps of decodes alone all take the
fused native step (``/metrics``). A first divergence is accepted only where transformers'
own top-1/top-2 log-prob gap is < 1e-3, and the greedy tokens' log-probs must agree
within 1e-3 up to it. A third server computes the long prompt in chunks of 40 tokens: its
sliding-window layers' KV group (docs/decisions.md D91) holds only what the window and a
chunk need, and `vlmd cost` sizes the same cache.
"""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from conftest import Server, image_data_url, random_image
from gemma3_oracle import hf_gemma3_generate
from oracle import assert_chat_parity
from vlmd.cost import CostOptions, compute_cost, parse_image
from vlmd.sched.block_pool import blocks_needed

LONG_TEXT = " ".join(["Describe what is here and what the image shows in some detail"] * 12)
PAN_AND_SCAN = orjson.dumps({"do_pan_and_scan": True}).decode()


def _image(seed, width, height):
    return random_image(seed, width, height)


# name -> (images, text, per-request mm_processor_kwargs, max_tokens)
CASES = {
    "one_image": ([_image(1, 80, 70)], "What is in this image?", {}, 10),
    "two_images_crops": ([_image(2, 200, 60), _image(3, 64, 64)], "Compare them.", {}, 12),
    "text_only": ([], "Write a short poem about the sea.", {}, 14),
    "tall_crops": ([_image(4, 60, 150)], "Describe the tall picture.", {}, 10),
    "crops_off": ([_image(5, 220, 70)], "Read the banner.", {"do_pan_and_scan": False}, 8),
    "long_after_image": ([_image(6, 90, 90)], LONG_TEXT, {}, 12),
}
# What the small server (no pan-and-scan) runs.
SMALL_CASES = ["one_image", "two_images_crops", "text_only", "long_after_image"]


def _body(images, text, kwargs, max_tokens, history=()):
    content = [{"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in images]
    content.append({"type": "text", "text": text})
    body = {"messages": [*history, {"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True, "logprobs": True}
    if kwargs:
        body["mm_processor_kwargs"] = kwargs
    return body


def _reference(model_dir, images, text, kwargs, max_tokens, pan_and_scan, history=()):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    crops = kwargs.get("do_pan_and_scan", pan_and_scan)
    return hf_gemma3_generate(model_dir, [*history, {"role": "user", "content": content}], images, max_tokens,
                              pan_and_scan=crops)


def _concurrently(server, bodies):
    def one(body):
        status, answer = server.chat(body)
        assert status == 200, answer
        return answer

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


@pytest.fixture(scope="module")
def references(tiny_gemma3_dir):
    return {name: _reference(tiny_gemma3_dir, *case, pan_and_scan=True) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def server(tiny_gemma3_dir, tmp_path_factory):
    # vlmd's products at every decode batch size: each step of decodes alone runs every layer
    # in one native call (the fused step), which ``test_decodes_took_the_fused_step`` counts.
    # Concurrent prompts share 8 long prefill tokens a step (D119), less than an image, whose
    # tokens go in one chunk (they attend both ways): the step's first long chunk takes it whole.
    server = Server(tiny_gemma3_dir, "--limit-mm-per-prompt", "image=3", "--max-model-len", "1024",
                    "--mm-processor-kwargs", PAN_AND_SCAN, "--linear-kernels", "native",
                    "--long-prefill-step-tokens", "8", log_dir=tmp_path_factory.mktemp("gemma3-logs"))
    yield server
    server.stop()


def test_prompts_run_past_the_window(references):
    """The long case is several windows long, its image at the start; crops happened."""
    assert len(references["long_after_image"]["prompt_token_ids"]) > 5 * 24
    assert len(references["two_images_crops"]["prompt_token_ids"]) > len(references["crops_off"]["prompt_token_ids"])


@pytest.mark.parametrize("name", list(CASES))
def test_parity_one_request(server, references, name):
    status, body = server.chat(_body(*CASES[name]))
    assert status == 200, body
    assert_chat_parity(body, references[name])


def test_parity_all_concurrently(server, references):
    bodies = _concurrently(server, [_body(*case) for case in CASES.values()])
    for name, body in zip(CASES, bodies):
        assert_chat_parity(body, references[name])


def test_decodes_took_the_fused_step(server):
    # After the parity cases above: every step of decodes alone ran Gemma 3's layers in one
    # native call (sliding layers through their window group's tables), none its modules.
    metrics = server.metrics()
    assert metrics['vlmd_decode_steps_total{path="fused"}'] > 0
    assert metrics['vlmd_decode_steps_total{path="modules"}'] == 0


def test_second_turn_reuses_the_first(server, tiny_gemma3_dir, references):
    images, text, kwargs, max_tokens = CASES["one_image"]
    first = references["one_image"]
    status, body = server.chat(_body(images, text, kwargs, max_tokens))
    assert status == 200, body
    answer = body["choices"][0]["message"]["content"]
    history = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(images[0])}},
                                            {"type": "text", "text": text}]},
               {"role": "assistant", "content": answer}]
    status, second = server.chat(_body([], "And what else?", {}, 10, history))
    assert status == 200, second
    ref_history = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]},
                   {"role": "assistant", "content": answer}]
    ref = hf_gemma3_generate(tiny_gemma3_dir, [*ref_history, {"role": "user", "content": [
        {"type": "text", "text": "And what else?"}]}], images, 10, pan_and_scan=True)
    assert_chat_parity(second, ref)
    # The first turn's prompt blocks (the image inside them) came from the prefix cache.
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (len(first["prompt_token_ids"]) // 16) * 16 > 0


def test_bad_input_is_a_400(server):
    image = _image(7, 64, 64)
    status, body = server.chat(_body([image] * 4, "Too many.", {}, 2))
    assert status == 400 and "image" in body["error"]["message"], body
    status, body = server.chat(_body([image], "Bad kwargs.", {"do_pan_and_scan": "yes"}, 2))
    assert status == 400 and body["error"]["param"] == "mm_processor_kwargs", body
    status, body = server.chat(_body([image], "More crops.", {"pan_and_scan_max_num_crops": 9}, 2))
    assert status == 400 and "crops" in body["error"]["message"], body
    bad = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}},
        {"type": "text", "text": "What?"}]}], "max_tokens": 2}
    status, body = server.chat(bad)
    assert status == 400, body
    status, body = server.chat(_body([], "Typed <start_of_image> marker.", {}, 2))
    assert status == 400 and "placeholder" in body["error"]["message"], body


def test_an_image_larger_than_a_step_is_a_startup_error(tiny_gemma3_dir, tmp_path):
    with pytest.raises(RuntimeError, match="--max-num-batched-tokens >= "):
        Server(tiny_gemma3_dir, "--max-num-batched-tokens", "12", "--max-model-len", "256", log_dir=tmp_path)


def test_small_budget_small_cache_tensor_parallel(tiny_gemma3_dir, tmp_path):
    """TP=2, 24 tokens a step (every image kept whole: a request that cannot fit its next
    image waits for a step with room), 30 KV blocks of 16 that every group shares (a
    384-token request holds 24 in the full layers and up to 4 in the window's): preemption."""
    refs = {name: _reference(tiny_gemma3_dir, *CASES[name], pan_and_scan=False) for name in SMALL_CASES}
    server = Server(tiny_gemma3_dir, "--limit-mm-per-prompt", "image=3", "--max-num-batched-tokens", "24",
                    "--num-kv-blocks", "30", "--max-model-len", "384", "--tensor-parallel-size", "2",
                    "--torch-threads", "1", log_dir=tmp_path)
    try:
        status, body = server.chat(_body(*CASES["tall_crops"][:2], {"do_pan_and_scan": True}, 2))
        assert status == 400 and "--mm-processor-kwargs" in body["error"]["message"], body
        for _ in range(3):  # preemption needs the requests to overlap: at most three rounds
            bodies = _concurrently(server, [_body(*CASES[name]) for name in SMALL_CASES] * 2)
            for name, body in zip(SMALL_CASES * 2, bodies):
                assert_chat_parity(body, refs[name])
            metrics = server.metrics()
            if metrics["vlmd_num_preemptions_total"] > 0:
                break
        assert metrics["vlmd_num_preemptions_total"] > 0, "the test meant to force preemption"
    finally:
        server.stop()


# A pool small enough that another long prompt reuses the window's freed blocks (every group
# takes its blocks from it): 1,024 tokens need 64 full-attention blocks and 5 in the window.
NUM_BLOCKS = 72


def test_a_long_prompt_holds_only_its_window(tiny_gemma3_dir, tmp_path):
    """The long case (an image, then several windows of text) in chunks of at most 40
    tokens: tokens equal transformers'; the full-attention layers hold a block per 16 tokens
    while the 24-token window's layers never held more for it than the window and one chunk
    can reach; every block goes back at the end. Sent again, the prompt hits the prefix cache
    whole; after another prompt reused the window group's blocks, the hit falls back to what
    every group still has, with the same tokens. `vlmd cost` with the same settings counts
    the same prompt, the same blocks in each group and the same KV bytes as the server's plan."""
    images, text, kwargs, max_tokens = CASES["long_after_image"]
    reference = _reference(tiny_gemma3_dir, images, text, kwargs, max_tokens, pan_and_scan=False)
    server = Server(tiny_gemma3_dir, "--max-num-batched-tokens", "40", "--max-model-len", "1024",
                    "--max-num-seqs", "4", "--num-kv-blocks", str(NUM_BLOCKS), log_dir=tmp_path)
    try:
        status, body = server.chat(_body(images, text, kwargs, max_tokens))
        assert status == 200, body
        assert_chat_parity(body, reference)
        metrics = server.metrics()
        # Sent again at once: every group still has its blocks cached, so the whole prompt hits.
        whole_hit = (len(reference["prompt_token_ids"]) - 1) // 16 * 16
        status, again = server.chat(_body(images, text, kwargs, max_tokens))
        assert status == 200, again
        assert_chat_parity(again, reference)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == whole_hit
        # Another long prompt takes the blocks freed longest ago (the window's, given back as it moved):
        # the full layers' blocks are still cached, the window before the hit's end is not, so
        # the hit falls back to a shorter one (or none) and the tokens are still transformers'.
        status, other = server.chat(_body([], "Other words entirely, " * 40, {}, 2))
        assert status == 200, other
        status, third = server.chat(_body(images, text, kwargs, max_tokens))
        assert status == 200, third
        assert_chat_parity(third, reference)
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] < whole_hit
    finally:
        server.stop()
    # The tiny Gemma 3's layers: sliding, full, sliding, full: two groups of two layers each.
    label = '{group="1",kind="sliding_window",window="24"}'
    tokens = len(reference["prompt_token_ids"]) + max_tokens
    peak = metrics["vlmd_kv_cache_group_peak_request_blocks" + label]
    # A chunk of n tokens at s reads [s - 23, s + n): at most (40 + 24 + 2 * 16 - 3) // 16 blocks.
    assert 0 < peak <= (40 + 24 + 2 * 16 - 3) // 16 == 5 < -(-tokens // 16)
    assert metrics["vlmd_kv_cache_group_peak_request_blocks" + '{group="0",kind="full_attention",window=""}'] \
        == blocks_needed(tokens - 1, 16)
    assert metrics["vlmd_kv_cache_group_blocks" + label] == 0  # the finished request gave all back

    report = compute_cost(str(tiny_gemma3_dir), [parse_image("90x90")],
                          CostOptions(prompt=text, max_num_batched_tokens=40, max_model_len=1024, max_num_seqs=4,
                                      num_kv_blocks=NUM_BLOCKS))
    assert report["prompt_tokens"] == body["usage"]["prompt_tokens"] == len(reference["prompt_token_ids"])
    cache = report["cache"]
    assert cache["num_kv_blocks"] == metrics["vlmd_memory_plan_kv_blocks"] == NUM_BLOCKS
    plan_kv = [value for key, value in metrics.items() if key.startswith("vlmd_memory_plan_bytes{")
               and 'part="kv_cache"' in key]
    assert plan_kv == [cache["kv_bytes"]]
    # The request's KV figure counts the window's blocks, not one per 16 tokens in every layer.
    request = report["requests"][0]
    full, windowed = request["kv_groups"]
    assert (full["kind"], windowed["window"]) == ("full_attention", 24)
    assert windowed["blocks"] < full["blocks"] == blocks_needed(request["kv_tokens"], 16)
    assert request["kv_bytes"] == (full["blocks"] + windowed["blocks"]) * cache["block_bytes"] \
        < 2 * full["blocks"] * cache["block_bytes"]


def _relayered(tiny_dir, out, layer_types: list[str], window: int):
    """The same weights with other layer kinds (Gemma 3's ``layer_types`` in its config)."""
    shutil.copytree(tiny_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["text_config"].update(layer_types=layer_types, sliding_window=window)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _most_running(model_dir, text: str, requests: int, log_dir) -> tuple[int, dict, int]:
    """``requests`` concurrent chats of ``text`` on a 0.02 GiB KV cache: the most /metrics
    showed running at once (polled while they run), the final metrics, one prompt's tokens.
    The per-step long-prefill bound is off (D119 admits a newcomer only while a step has
    long-prefill tokens left, which holds the running count below what the cache holds):
    this measures what the KV model holds, not the step policy."""
    server = Server(model_dir, "--max-model-len", "2048", "--max-num-seqs", "256", "--long-prefill-step-tokens", "0",
                    kv_cache_gb="0.02", log_dir=log_dir)
    most, done = 0, threading.Event()

    def poll():
        nonlocal most
        while not done.is_set():
            most = max(most, server.metrics()["vlmd_num_requests_running"])

    # Each prompt its own first words: no two share a prefix block.
    bodies = [{"model": server.model, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
               "messages": [{"role": "user", "content": f"{index} {text}"}]} for index in range(requests)]
    try:
        watcher = threading.Thread(target=poll)
        watcher.start()
        try:
            answers = _concurrently(server, bodies)
        finally:
            done.set()
            watcher.join()
        return int(most), server.metrics(), answers[0]["usage"]["prompt_tokens"]
    finally:
        server.stop()


def test_windows_hold_more_concurrent_requests_than_the_same_layers_all_full(tiny_gemma3_dir, tmp_path):
    """The KV model (D95) through the front door: the same weights with three of four layers
    windowed (window 32) and with every layer full attention, each on the same --kv-cache-gb,
    30 concurrent ~1,450-token chats: the windowed server runs ~3.5x as many at once (its
    windows' blocks serve any group), as many as `vlmd cost` says the pool holds (a prompt's
    first chunk takes its blocks in every group before the windows give them back: up to a
    few short; one admitted on a chunk's blocks may be preempted later: up to one over), and
    every block is back at the end."""
    windowed = _relayered(tiny_gemma3_dir, tmp_path / "windowed", ["sliding_attention"] * 3 + ["full_attention"], 32)
    all_full = _relayered(tiny_gemma3_dir, tmp_path / "all-full", ["full_attention"] * 4, 32)
    text = "the " * 1440
    full_most, full_metrics, prompt_tokens = _most_running(all_full, text, 30, tmp_path)
    window_most, window_metrics, _ = _most_running(windowed, text, 30, tmp_path)
    assert 1400 < prompt_tokens < 1500
    options = CostOptions(prompt=f"0 {text}", max_tokens=32, max_model_len=2048, max_num_seqs=256, kv_cache_gb=0.02)
    held = {}
    for name, model_dir, metrics in (("full", all_full, full_metrics), ("windowed", windowed, window_metrics)):
        report = compute_cost(str(model_dir), [], options)
        assert report["requests"][0]["prompt_tokens"] == prompt_tokens
        assert report["cache"]["num_kv_blocks"] == metrics["vlmd_memory_plan_kv_blocks"]
        assert metrics["vlmd_kv_cache_free_blocks"] == metrics["vlmd_kv_cache_total_blocks"]
        held[name] = report["cache"]["requests_held"]
    # Running counts a request from its first chunk: one more may be admitted on a chunk's
    # blocks before the others' growth preempts it.
    figures = (full_most, held["full"], window_most, held["windowed"])
    assert held["full"] <= full_most <= held["full"] + 1, figures
    assert held["windowed"] - 3 <= window_most <= held["windowed"] + 1, figures
    assert held["windowed"] >= 3.5 * held["full"] and window_most >= 3 * held["full"], figures
