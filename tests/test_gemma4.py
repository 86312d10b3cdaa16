"""Gemma 4 (text) through the real server: greedy tokens equal transformers' generate.

The tiny checkpoint (``vlmd_gemma4/tiny.py``) has six layers, sliding, sliding, full,
sliding | sliding, full, the last two reading the K/V of layers 3 and 2 and holding none
(docs/decisions.md D111); a 24-token window, so the prompts here run past it; heads of 32 on
windowed layers and 64 (proportional RoPE) on full ones; per-layer embeddings. Cases run
alone, then all concurrently; then a second turn (``cached_tokens``). A second server with
a token budget of 16 a step and a KV cache small enough to preempt runs them concurrently.
A first divergence is accepted only where transformers' own top-1/top-2 log-prob gap is
< 1e-3, and the greedy tokens' log-probs must agree within 1e-3 up to it. `vlmd cost` counts
the server's prompt and shows the shared layers holding nothing.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Server, image_data_url, random_image
from gemma4_oracle import hf_gemma4_generate
from oracle import assert_chat_parity
from vlmd.cost import CostOptions, compute_cost
from vlmd.sched.block_pool import blocks_needed

LONG_TEXT = " ".join(["Describe the sea and the poem and what is here in some detail"] * 10)

# name -> (messages before the last, the last user text, max_tokens)
CASES = {
    "short": ((), "Write a short poem about the sea.", 12),
    "long": ((), LONG_TEXT, 14),
    "system": (({"role": "system", "content": "You answer in one line."},), "What is the sea?", 10),
    "two_parts": ((), ["Describe", "the sea and the poem."], 10),
}


def _content(text):
    parts = [text] if isinstance(text, str) else text
    return [{"type": "text", "text": part} for part in parts]


def _messages(history, text):
    return [*history, {"role": "user", "content": _content(text)}]


def _body(history, text, max_tokens):
    return {"messages": _messages(history, text), "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "logprobs": True}


def _reference(model_dir, history, text, max_tokens):
    return hf_gemma4_generate(model_dir, _messages(history, text), max_tokens)


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
    server = Server(tiny_gemma4_dir, "--max-model-len", "1024", log_dir=tmp_path_factory.mktemp("gemma4-logs"))
    yield server
    server.stop()


def test_prompts_run_past_the_window(references):
    assert len(references["long"]["prompt_token_ids"]) > 4 * 24
    assert all(len(ref["output_token_ids"]) > 3 for ref in references.values())


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
    history, text, max_tokens = CASES["long"]
    first = references["long"]
    status, body = server.chat(_body(history, text, max_tokens))
    assert status == 200, body
    answer = body["choices"][0]["message"]["content"]
    turns = ({"role": "user", "content": _content(text)}, {"role": "assistant", "content": answer})
    status, second = server.chat(_body(turns, "And what else?", 10))
    assert status == 200, second
    assert_chat_parity(second, _reference(tiny_gemma4_dir, turns, "And what else?", 10))
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (len(first["prompt_token_ids"]) // 16) * 16 > 0


def test_media_parts_are_refused_until_the_towers_come(server):
    body = _body((), "What is this?", 2)
    body["messages"][0]["content"].insert(0, {"type": "image_url",
                                              "image_url": {"url": image_data_url(random_image(1, 32, 32))}})
    status, answer = server.chat(body)
    assert status == 400 and "image" in answer["error"]["message"], answer


def test_cost_counts_the_servers_prompt_and_no_kv_for_shared_layers(server, tiny_gemma4_dir, references):
    history, text, max_tokens = CASES["short"]
    report = compute_cost(str(tiny_gemma4_dir), [], CostOptions(prompt=text, max_tokens=max_tokens,
                                                                max_model_len=1024))
    assert report["prompt_tokens"] == len(references["short"]["prompt_token_ids"])
    assert report["cache"]["shared_kv_layers"] == [[4, 3], [5, 2]]
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


def test_small_budget_small_cache_preempts_with_the_same_tokens(tiny_gemma4_dir, references, tmp_path):
    """16 tokens a step (every prompt in chunks, the window's blocks given back as they go)
    and 40 KV blocks of 16 shared by every group: concurrent requests preempt each other."""
    server = Server(tiny_gemma4_dir, "--max-num-batched-tokens", "16", "--num-kv-blocks", "40",
                    "--max-model-len", "384", log_dir=tmp_path)
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
