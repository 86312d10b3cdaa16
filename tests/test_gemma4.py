"""Gemma 4 through the real server: greedy tokens equal transformers' generate.

The tiny checkpoint (``vlmd_gemma4/tiny.py``) has six layers, sliding, sliding, full,
sliding | sliding, full, the last two reading the K/V of layers 3 and 2 and holding none
(docs/decisions.md D111); a 24-token window, so the prompts here run past it; heads of 32 on
windowed layers and 64 (proportional RoPE) on full ones; per-layer embeddings; a vision tower
whose images cost up to 140 soft tokens (4-px patches pooled 3 x 3), a budget a request may
lower. Cases: one image, the same image at a budget of 70, two images of other shapes, text
(short, long, with a system prompt, in two parts). Each runs alone, then all concurrently;
then a second turn (``cached_tokens``). A second server, with tensor parallelism over 2
ranks, a token budget of 16 a step (images split across steps) and a KV cache small enough
to preempt, runs them concurrently.
A first divergence is accepted only where transformers' own top-1/top-2 log-prob gap is
< 1e-3, and the greedy tokens' log-probs must agree within 1e-3 up to it. `vlmd cost`
counts the server's prompt and shows the shared layers holding nothing. The
mixture-of-experts variant (``gemma4_moe``) runs some of the cases on a third server, and
the same weights with images attending both ways on the sliding layers on a fourth.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Server, image_data_url, random_image
from gemma4_oracle import hf_gemma4_generate
from oracle import assert_chat_parity
from vlmd.cost import CostOptions, compute_cost, format_table, parse_image
from vlmd.sched.block_pool import blocks_needed

LONG_TEXT = " ".join(["Describe the sea and the poem and what is here in some detail"] * 10)
IMAGE = random_image(1, 80, 70)

# name -> (messages before the last, images, the last user text, mm_processor_kwargs, max_tokens)
CASES = {
    "one_image": ((), [IMAGE], "Describe the image.", {}, 10),
    "budget_70": ((), [IMAGE], "Describe the image.", {"max_soft_tokens": 70}, 10),
    "two_images": ((), [random_image(2, 120, 50), random_image(3, 40, 90)], "Compare them.", {}, 12),
    "short": ((), [], "Write a short poem about the sea.", {}, 12),
    "long": ((), [], LONG_TEXT, {}, 14),
    "system": (({"role": "system", "content": "You answer in one line."},), [], "What is the sea?", {}, 10),
    "two_parts": ((), [], ["Describe", "the sea and the poem."], {}, 10),
}


def _texts(text):
    return [text] if isinstance(text, str) else text


def _body(history, images, text, kwargs, max_tokens):
    content = [{"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in images]
    content += [{"type": "text", "text": part} for part in _texts(text)]
    body = {"messages": [*history, {"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True, "logprobs": True}
    if kwargs:
        body["mm_processor_kwargs"] = kwargs
    return body


def _reference(model_dir, history, images, text, kwargs, max_tokens):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": part} for part in _texts(text)]
    return hf_gemma4_generate(model_dir, [*history, {"role": "user", "content": content}], images, max_tokens,
                              kwargs.get("max_soft_tokens"))


def report_image_token(model_dir) -> int:
    import json

    return json.loads((model_dir / "vlmd_tiny.json").read_text())["image_token_id"]


def _concurrently(server, bodies):
    def one(body):
        status, answer = server.chat(body)
        assert status == 200, answer
        return answer

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


@pytest.fixture(scope="module")
def references(tiny_gemma4_dir):
    return {name: _reference(tiny_gemma4_dir, *case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def server(tiny_gemma4_dir, tmp_path_factory):
    server = Server(tiny_gemma4_dir, "--max-model-len", "1024", "--limit-mm-per-prompt", "image=2,video=0",
                    log_dir=tmp_path_factory.mktemp("gemma4-logs"))
    yield server
    server.stop()


def test_prompts_run_past_the_window_and_the_budget_counts(references):
    assert len(references["long"]["prompt_token_ids"]) > 4 * 24
    assert all(len(ref["output_token_ids"]) > 3 for ref in references.values())
    # The same image at a budget of 70 costs fewer tokens than at the server's 140.
    assert len(references["budget_70"]["prompt_token_ids"]) < len(references["one_image"]["prompt_token_ids"]) - 40


@pytest.mark.parametrize("name", list(CASES))
def test_parity_one_request(server, references, name):
    status, body = server.chat(_body(*CASES[name]))
    assert status == 200, body
    assert_chat_parity(body, references[name])


def test_parity_all_concurrently(server, references):
    bodies = _concurrently(server, [_body(*case) for case in CASES.values()] * 2)
    for name, body in zip(list(CASES) * 2, bodies):
        assert_chat_parity(body, references[name])


def test_second_turn_reuses_the_first(server, tiny_gemma4_dir, references):
    history, images, text, kwargs, max_tokens = CASES["one_image"]
    first = references["one_image"]
    status, body = server.chat(_body(history, images, text, kwargs, max_tokens))
    assert status == 200, body
    answer = body["choices"][0]["message"]["content"]
    turns = ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(IMAGE)}},
                                          {"type": "text", "text": text}]},
             {"role": "assistant", "content": answer})
    status, second = server.chat(_body(turns, [], "And what else?", {}, 10))
    assert status == 200, second
    ref_turns = ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]},
                 {"role": "assistant", "content": answer})
    ref = hf_gemma4_generate(tiny_gemma4_dir, [*ref_turns, {"role": "user", "content": [
        {"type": "text", "text": "And what else?"}]}], images, 10)
    assert_chat_parity(second, ref)
    # The first turn's prompt blocks (the image inside them) came from the prefix cache.
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (len(first["prompt_token_ids"]) // 16) * 16 > 0


def test_bad_input_is_a_400(server):
    for kwargs, words in (({"max_soft_tokens": 280}, "past this server"), ({"max_soft_tokens": 100}, "one of")):
        status, body = server.chat(_body((), [IMAGE], "Too many.", kwargs, 2))
        assert status == 400 and body["error"]["param"] == "mm_processor_kwargs" and words in body["error"]["message"]
    status, body = server.chat(_body((), [], "Typed <|image|> marker.", {}, 2))
    assert status == 400 and "placeholder" in body["error"]["message"], body
    status, body = server.chat({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}], "max_tokens": 2})
    assert status == 400, body


def test_cost_counts_the_servers_prompt_and_no_kv_for_shared_layers(server, tiny_gemma4_dir, references):
    history, images, text, kwargs, max_tokens = CASES["one_image"]
    report = compute_cost(str(tiny_gemma4_dir), [parse_image("80x70")],
                          CostOptions(prompt=text, max_tokens=max_tokens, max_model_len=1024))
    assert report["prompt_tokens"] == len(references["one_image"]["prompt_token_ids"])
    assert report["items"][0]["placeholder_tokens"] == references["one_image"]["prompt_token_ids"].count(
        report_image_token(tiny_gemma4_dir))
    assert report["cache"]["shared_kv_layers"] == [[4, 3], [5, 2]]
    assert "2 layers read an earlier layer's K/V and hold none: 4<-3, 5<-2" in format_table(report)
    request = report["requests"][0]
    owned = sorted(layer for group in request["kv_groups"] for layer in group["layers"])
    assert owned == [0, 1, 2, 3]  # layers 4 and 5 hold nothing
    # Four layers' K/V at the pool's slot width (2 heads x 64, the full layers'), float32.
    assert report["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 4
    # One full layer, so groups of one layer: the full one, then the three windowed ones.
    full, *windowed = request["kv_groups"]
    assert (full["kind"], full["layers"]) == ("full_attention", [2])
    assert [(group["window"], group["layers"]) for group in windowed] == [(24, [0]), (24, [1]), (24, [3])]
    assert full["blocks"] == blocks_needed(request["kv_tokens"], 16)
    assert report["cache"]["layer_slots"] == 1


def test_small_budget_small_cache_tensor_parallel(tiny_gemma4_dir, references, tmp_path):
    """TP=2 (each rank half the heads of every layer, sharing layers' queries included),
    16 tokens a step (every prompt and image in chunks, the window's blocks given back as
    they go) and 40 KV blocks of 16 shared by every group: concurrent requests preempt each
    other."""
    server = Server(tiny_gemma4_dir, "--max-num-batched-tokens", "16", "--num-kv-blocks", "40",
                    "--max-model-len", "384", "--limit-mm-per-prompt", "image=2,video=0", "--tensor-parallel-size", "2",
                    "--torch-threads", "1", log_dir=tmp_path)
    try:
        for _ in range(3):  # preemption needs the requests to overlap: at most three rounds
            bodies = _concurrently(server, [_body(*case) for case in CASES.values()] * 2)
            for name, body in zip(list(CASES) * 2, bodies):
                assert_chat_parity(body, references[name])
            metrics = server.metrics()
            if metrics["vlmd_num_preemptions_total"] > 0:
                break
        assert metrics["vlmd_num_preemptions_total"] > 0, "the test meant to force preemption"
        assert metrics["vlmd_kv_cache_free_blocks"] == metrics["vlmd_kv_cache_total_blocks"]
    finally:
        server.stop()


MOE_CASES = ["one_image", "two_images", "short", "long"]


def test_the_mixture_of_experts_variant(tiny_gemma4_moe_dir, tmp_path):
    """Routed experts (4, 2 a token) beside every layer's MLP, each rank of 2 holding every
    expert's half of the intermediate columns: the cases concurrently, twice."""
    refs = {name: _reference(tiny_gemma4_moe_dir, *CASES[name]) for name in MOE_CASES}
    server = Server(tiny_gemma4_moe_dir, "--max-model-len", "1024", "--limit-mm-per-prompt", "image=2,video=0",
                    "--tensor-parallel-size", "2", "--torch-threads", "1", log_dir=tmp_path)
    try:
        bodies = _concurrently(server, [_body(*CASES[name]) for name in MOE_CASES] * 2)
        for name, body in zip(MOE_CASES * 2, bodies):
            assert_chat_parity(body, refs[name])
    finally:
        server.stop()


def _bidirectional(tiny_dir, out):
    """The same weights with images attending both ways on the sliding layers (Gemma 4's
    larger checkpoints' ``use_bidirectional_attention="vision"``)."""
    import json
    import shutil

    shutil.copytree(tiny_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (out / "config.json").write_text(json.dumps(config))
    return out


BIDIRECTIONAL_CASES = ["one_image", "budget_70", "two_images", "long"]


def test_images_attend_both_ways_on_the_sliding_layers(tiny_gemma4_dir, tmp_path):
    """An image's soft tokens see each other both ways on the sliding layers (within the
    24-token window: the images here are 56-132 tokens), causally on the full ones; each image
    computed in one step of at most 140 tokens while text chunks around it."""
    model_dir = _bidirectional(tiny_gemma4_dir, tmp_path / "bidirectional")
    refs = {name: _reference(model_dir, *CASES[name]) for name in BIDIRECTIONAL_CASES}
    causal = {name: _reference(tiny_gemma4_dir, *CASES[name]) for name in ("one_image", "two_images")}
    assert any(refs[name]["output_token_ids"] != causal[name]["output_token_ids"] for name in causal)
    server = Server(model_dir, "--max-model-len", "1024", "--limit-mm-per-prompt", "image=2,video=0",
                    "--max-num-batched-tokens", "140", log_dir=tmp_path)
    try:
        bodies = _concurrently(server, [_body(*CASES[name]) for name in BIDIRECTIONAL_CASES] * 2)
        for name, body in zip(BIDIRECTIONAL_CASES * 2, bodies):
            assert_chat_parity(body, refs[name])
    finally:
        server.stop()
