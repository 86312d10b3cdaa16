"""Llama 3.2 Vision through the real server: greedy tokens equal transformers' generate.

The tiny checkpoint has 56-px tiles, at most 2 an image, and cross-attention layers 1 and 3 of
5. Cases: one tile, a wide and a tall strip (the most tiles), two images, text only, text
before the image (those rows attend to the images unmasked and skip the layer's MLP, as in
transformers) and two images with text between them (each text span sees its own image).
Each runs alone, then all concurrently (prefix hits: the images' K/V are derived again for
the rows after the hit); a second turn over the first one's answer finds it cached; the same
text after another image shares no block; bad input gets a 4xx and the next good request its
answer. The server's token budget (16) splits every
prompt across steps, so the cross-attention K/V built with the first chunk serve the later
ones; run concurrently, the prompts' chunks share 6 tokens a step (``--long-prefill-step-tokens``,
D119), each chunk still under its request's images. ``usage.prompt_tokens`` and ``/tokenize`` equal transformers' processor's count. A first
divergence is accepted only where transformers' own top-1/top-2 log-prob gap is < 1e-3, and
the greedy tokens' log-probs agree within 1e-3 up to it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from conftest import Server, image_data_url, random_image
from mllama_oracle import hf_mllama_generate
from oracle import assert_chat_parity

TOKEN_BUDGET = 16
LONG_PREFILL_BOUND = 6  # a step's long prefill tokens while requests share the engine (D119)

# name: (parts, max_tokens); a part is text or (seed, width, height) of an image
CASES = {
    "one_tile_50x40": ([(1, 50, 40), "What is in this image?"], 8),
    "wide_300x40": ([(2, 300, 40), "Read the banner."], 10),
    "tall_40x300": ([(3, 40, 300), "Describe the tall picture."], 12),
    "two_images": ([(4, 120, 90), (5, 70, 200), "Compare them."], 14),
    "text_only": (["Write a short poem about the sea."], 10),
    "text_before_image": (["Look at this one:", (6, 90, 60), "What colour is it?"], 12),
    "text_between_images": ([(7, 64, 64), "First this, then", (8, 200, 100), "which is brighter?"], 12),
}
CASE_NAMES = list(CASES)


def _images(name):
    return [random_image(*part) for part in CASES[name][0] if not isinstance(part, str)]


def _body(name: str) -> dict:
    parts, max_tokens = CASES[name]
    content = [{"type": "text", "text": part} if isinstance(part, str)
               else {"type": "image_url", "image_url": {"url": image_data_url(random_image(*part))}} for part in parts]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "logprobs": True}


def _reference_messages(name: str) -> list[dict]:
    parts, _ = CASES[name]
    return [{"role": "user", "content": [{"type": "text", "text": part} if isinstance(part, str) else {"type": "image"}
                                         for part in parts]}]


@pytest.fixture(scope="module")
def references(tiny_mllama_dir):
    return {name: hf_mllama_generate(tiny_mllama_dir, _reference_messages(name), _images(name), CASES[name][1])
            for name in CASE_NAMES}


@pytest.fixture(scope="module")
def server(tiny_mllama_dir, tmp_path_factory):
    # Two images' tower outputs (2 x 34 vectors) must fit one step's encoder budget: a
    # request's images are all encoded with its first chunk.
    server = Server(tiny_mllama_dir, "--limit-mm-per-prompt", "image=2", "--max-model-len", "1024",
                    "--max-num-batched-tokens", str(TOKEN_BUDGET), "--max-num-encoder-input-tokens", "68",
                    "--encoder-cache-size", "136", "--long-prefill-step-tokens", str(LONG_PREFILL_BOUND),
                    log_dir=tmp_path_factory.mktemp("mllama-logs"))
    yield server
    server.stop()


def test_the_images_change_the_answer(references):
    """The gates are open: an image changes what follows it (else parity would prove little)."""
    outputs = {tuple(references[name]["output_token_ids"]) for name in CASE_NAMES}
    assert len(outputs) == len(CASE_NAMES)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_parity_one_request(server, references, name):
    steps_before = server.metrics()["vlmd_engine_steps_total"]
    status, body = server.chat(_body(name))
    assert status == 200, body
    assert_chat_parity(body, references[name])
    # The prompt took a step per 16 tokens at least: it was split across steps.
    assert server.metrics()["vlmd_engine_steps_total"] - steps_before >= body["usage"]["prompt_tokens"] // TOKEN_BUDGET


@pytest.mark.parametrize("name", ["two_images", "text_before_image", "text_only"])
def test_tokenize_counts_equal_the_processors(server, references, name):
    request = {"model": server.model, "messages": _body(name)["messages"]}
    status, raw = server.request("POST", "/tokenize", orjson.dumps(request))
    tokens = orjson.loads(raw)
    assert status == 200, tokens
    assert tokens["tokens"] == references[name]["prompt_token_ids"]
    assert tokens["count"] == len(references[name]["prompt_token_ids"])


def test_parity_all_concurrently(server, references):
    def one(name):
        status, body = server.chat(_body(name))
        assert status == 200, body
        return body

    with ThreadPoolExecutor(len(CASE_NAMES)) as pool:
        bodies = list(pool.map(one, CASE_NAMES))
    for name, body in zip(CASE_NAMES, bodies):
        assert_chat_parity(body, references[name])


def test_second_turn(server, references, tiny_mllama_dir):
    name = "two_images"
    answer = server.chat(_body(name))[1]["choices"][0]["message"]["content"]
    first = _body(name)["messages"][0]
    status, body = server.chat({"messages": [first, {"role": "assistant", "content": answer},
                                             {"role": "user", "content": "And the colours?"}],
                                "max_tokens": 10, "temperature": 0, "return_token_ids": True, "logprobs": True})
    assert status == 200, body
    history = [*_reference_messages(name), {"role": "assistant", "content": [{"type": "text", "text": answer}]},
               {"role": "user", "content": [{"type": "text", "text": "And the colours?"}]}]
    assert_chat_parity(body, hf_mllama_generate(tiny_mllama_dir, history, _images(name), 10))
    # The first turn's prompt is in the prefix cache, whole blocks of it; the images' K/V were
    # derived again for the rows after the hit.
    first_prompt = len(references[name]["prompt_token_ids"])
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_prompt // 16 * 16 > 0


def test_same_text_other_image_shares_no_blocks(server, references, tiny_mllama_dir):
    """Block hashes name the images: the same text after another image is computed anew (a
    token before the image attends to it too) and equals transformers' answer."""
    name = "text_before_image"
    parts, max_tokens = CASES[name]
    other = (16, 90, 60)
    body = _body(name)
    body["messages"][0]["content"][1]["image_url"]["url"] = image_data_url(random_image(*other))
    status, answer = server.chat(body)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens_details"].get("cached_tokens", 0) == 0
    assert_chat_parity(answer, hf_mllama_generate(tiny_mllama_dir, _reference_messages(name), [random_image(*other)], max_tokens))


def test_structured_output_with_an_image(server):
    """Constraints work on this family as on the others, though its tokenizer names a token (the
    image's) the head has no row for: the grammar's vocabulary covers it, the mask reads the
    logits' bits only."""
    image = {"type": "image_url", "image_url": {"url": image_data_url(random_image(12, 120, 80))}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "Which colour?"}]}]
    status, body = server.chat({"messages": messages, "max_tokens": 8, "temperature": 0,
                                "structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] in {"red", "green", "blue"}
    status, body = server.chat({"messages": messages, "max_tokens": 40, "temperature": 0,
                                "response_format": {"type": "json_object"}})
    assert status == 200, body
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(orjson.loads(body["choices"][0]["message"]["content"]), dict), body


def test_bad_input_is_a_4xx_then_a_good_request_is_answered(server, references):
    url = image_data_url(random_image(9, 80, 80))
    image = {"type": "image_url", "image_url": {"url": url}}
    bad = [
        {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "Hi"}]}], "max_tokens": 2,
         "mm_processor_kwargs": {"max_image_tiles": 4}},  # the tower's tile embeddings fix it
        {"messages": [{"role": "user", "content": [image, image, image, {"type": "text", "text": "Hi"}]}],
         "max_tokens": 2},  # over --limit-mm-per-prompt
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
         "max_tokens": 2},  # not an image
        {"messages": [{"role": "user", "content": "a typed <|image|> marker"}], "max_tokens": 2},
    ]
    for body in bad:
        status, answer = server.chat(body)
        assert 400 <= status < 500, (body, status, answer)
        assert answer["error"]["message"], answer
    status, body = server.chat(_body("two_images"))
    assert status == 200, body
    assert_chat_parity(body, references["two_images"])


def test_parity_tp2_split_across_steps_and_preempted(tiny_mllama_dir, references, tmp_path):
    """One start covers the hard regimes, as the other families' TP tests do (rank processes
    cost seconds to start): two ranks (the cross-attention heads split, the tower on both), a
    token budget that splits prompts across steps and a KV cache that preempts requests whose
    cross-attention K/V are then built again."""
    server = Server(tiny_mllama_dir, "--tensor-parallel-size", "2", "--torch-threads", "1",
                    "--limit-mm-per-prompt", "image=2", "--max-num-batched-tokens", str(TOKEN_BUDGET),
                    "--max-num-encoder-input-tokens", "68", "--encoder-cache-size", "136",
                    "--num-kv-blocks", "40", "--max-model-len", "128", log_dir=tmp_path)
    try:
        # Preemption needs the requests to overlap, which depends on when each one's
        # preprocessing ends on a loaded host: every round is checked, at most three are sent.
        for _ in range(3):
            with ThreadPoolExecutor(len(CASE_NAMES)) as pool:
                bodies = list(pool.map(lambda name: server.chat(_body(name)), CASE_NAMES))
            for name, (status, body) in zip(CASE_NAMES, bodies):
                assert status == 200, body
                assert_chat_parity(body, references[name])
            metrics = server.metrics()
            if metrics["vlmd_num_preemptions_total"] > 0:
                break
        assert metrics["vlmd_num_preemptions_total"] > 0, "the test meant to force preemption"
        # Cross-attention K/V take their blocks from the one pool every group shares; every
        # request's blocks, the preempted ones' included, came back when it finished (D93, D95).
        cross = {key.split("{")[0]: value for key, value in metrics.items()
                 if key.startswith("vlmd_kv_cache_group_") and 'kind="cross_attention"' in key}
        assert cross["vlmd_kv_cache_group_peak_request_blocks"] > 0
        assert cross["vlmd_kv_cache_group_blocks"] == 0
        assert metrics["vlmd_kv_cache_free_blocks"] == metrics["vlmd_kv_cache_total_blocks"] == 40
    finally:
        server.stop()
