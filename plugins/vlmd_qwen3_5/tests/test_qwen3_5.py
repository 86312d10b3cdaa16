"""Qwen3.5 (hybrid Gated DeltaNet / gated attention) through the real server: greedy tokens
equal transformers' generate.

Cases: text only; a 640x480 image; two images of different sizes; a 4 s video (8 of its 16
frames kept at the checkpoint's 2 fps, four frame pairs under their timestamps); and a text
prompt of some 200 tokens. The server's token budget (``--max-num-batched-tokens 64``) splits
every prompt longer than 64 tokens into chunks, so each linear-attention layer's recurrent
state (its convolution's last inputs and its delta-rule matrix) is carried from chunk to
chunk in the KV model's state pages; the tiny checkpoint's states decay slowly enough (see
``vlmd_qwen3_5.tiny``) that a state lost between chunks changes the tokens. Each case runs
alone, then all concurrently. transformers' ``Qwen3_5ForConditionalGeneration`` (float32,
its torch delta rule and convolution) with Qwen3-VL's processor is the oracle
(tests/qwen3_vl_oracle.py loads whatever class the checkpoint names); a first divergence is
accepted only at a near tie (tests/oracle.py), and the greedy tokens' log-probs must agree
within 1e-3 up to it.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Server, random_image
from oracle import assert_chat_parity
from test_qwen3_vl import MEDIA_IO, _body, _max_tokens, _reference, _run_concurrently, decoded_video
# Qwen3-VL's bad-input cases (its processor is this family's), run against this module's server.
from test_qwen3_vl import test_bad_input_is_a_400_and_the_server_still_serves  # noqa: F401

CASE_NAMES = ["text_only", "image_640x480", "two_images", "video", "long_text"]
BUDGET = 64  # --max-num-batched-tokens: the chunk a long prompt is split into
BLOCK_SIZE = 16  # the server's default
LONG_TEXT = " ".join(f"Line {index}: the tide comes in over the stones and goes out again." for index in range(14))


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory):
    from vlmd.testing.tiny import build_tiny

    return build_tiny("qwen3_5", tmp_path_factory.mktemp("tiny-qwen3-5"), seed=0, size="tiny")


def _cases():
    image = lambda seed, w, h: {"type": "image", "media": random_image(seed, w, h)}  # noqa: E731
    cases = {
        "text_only": ([], "Write a short poem about the sea.", {}, None),
        "image_640x480": ([image(1, 640, 480)], "What is in this image?", {}, None),
        "two_images": ([image(4, 320, 240), image(5, 500, 300)], "Compare them.", {}, None),
        # Frames at a multiple of 32 px within the video limits: no resize (the oracle resizes none).
        "video": ([decoded_video(16, 128, 96, fps=4, seed=3)], "What happens in the video?", {}, None),
        "long_text": ([], LONG_TEXT + " What comes next?", {}, None),
    }
    assert list(cases) == CASE_NAMES
    return cases


@pytest.fixture(scope="module")
def cases():
    return list(_cases().items())


@pytest.fixture(scope="module")
def references(tiny_qwen3_5_dir, cases):
    return {name: _reference(tiny_qwen3_5_dir, *case, _max_tokens(i)) for i, (name, case) in enumerate(cases)}


FLAGS = ("--limit-mm-per-prompt", "image=2,video=1", "--max-model-len", "1024", "--max-num-seqs", "8",
         "--max-num-batched-tokens", str(BUDGET), "--media-io-kwargs", MEDIA_IO)


@pytest.fixture(scope="module")
def server(tiny_qwen3_5_dir, tmp_path_factory):
    server = Server(tiny_qwen3_5_dir, *FLAGS, log_dir=tmp_path_factory.mktemp("qwen3-5-logs"))
    yield server
    server.stop()


def test_parity_one_request_at_a_time(server, cases, references):
    """In order; the long prompt's chunks are steps of their own (nothing else runs), so the
    steps it took count its chunks."""
    for index, (name, case) in enumerate(cases):
        steps_before = server.metrics()["vlmd_engine_steps_total"]
        status, body = server.chat(_body(*case, _max_tokens(index)))
        assert status == 200, body
        assert_chat_parity(body, references[name])
        if name == "long_text":
            prompt_tokens = body["usage"]["prompt_tokens"]
            assert prompt_tokens > 3 * BUDGET, prompt_tokens
            steps = server.metrics()["vlmd_engine_steps_total"] - steps_before
            assert steps >= -(-prompt_tokens // BUDGET) + body["usage"]["completion_tokens"] - 1, steps


def test_parity_all_concurrently(server, cases, references):
    for (name, _), body in zip(cases, _run_concurrently(server, cases)):
        assert_chat_parity(body, references[name])


def test_eight_concurrent_image_requests(server, tiny_qwen3_5_dir):
    """Eight image requests at once (a peer's Qwen3.5 died at two): each answer is
    transformers', however the steps batch and split them."""
    requests = [([{"type": "image", "media": random_image(50 + index, 160 + 64 * index, 480 - 32 * index)}],
                 f"Question {index}: what is in this image?") for index in range(8)]
    references = [_reference(tiny_qwen3_5_dir, parts, text, {}, None, 6) for parts, text in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda request: server.chat(_body(*request, {}, None, 6)), requests))
    for (status, body), reference in zip(answers, references):
        assert status == 200, body
        assert_chat_parity(body, reference)
    # What one request's states hold, per recurrent-state group, in /metrics is vlmd cost's
    # figure: its pages and, at the pool's block bytes, its bytes.
    from vlmd.cost import CostOptions, compute_cost, parse_image

    report = compute_cost(str(tiny_qwen3_5_dir), [parse_image("160x480")], CostOptions(max_tokens=6))
    expected = {str(group["group"]): group["blocks"] for group in report["requests"][0]["kv_groups"]
                if group["kind"] == "recurrent_state"}
    metrics = server.metrics()
    held = {name.split('group="', 1)[1].split('"', 1)[0]: int(value) for name, value in metrics.items()
            if name.startswith("vlmd_kv_cache_group_peak_request_blocks{") and 'kind="recurrent_state"' in name}
    assert len(expected) == 3 and held == expected
    assert metrics["vlmd_memory_plan_kv_block_bytes"] == report["cache"]["block_bytes"]


def _image_span(body, model_dir) -> tuple[int, int]:
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    rows = [index for index, token in enumerate(body["prompt_token_ids"]) if token == image_token]
    return rows[0], rows[-1] + 1


def test_another_question_and_a_second_turn_start_from_the_image_s_state(server, tiny_qwen3_5_dir):
    """Prefix hits on a hybrid model (D105): the recurrent states are kept at the last block
    boundary at or before the image's end and before the prompt's last token, so another
    question about the same image reuses the image's blocks and states, and a second turn
    about it the whole first prompt's but its last block; the answers are still
    transformers'."""
    parts = [{"type": "image", "media": random_image(40, 500, 400)}]
    turns = [("What is in this image?", None), ("Describe its colours.", None),
             ("What is in this image?", ("It is a picture of noise.", "And its colours?"))]
    bodies = []
    for text, follow_up in turns:
        status, body = server.chat(_body(parts, text, {}, follow_up, 6))
        assert status == 200, body
        assert_chat_parity(body, _reference(tiny_qwen3_5_dir, parts, text, {}, follow_up, 6))
        bodies.append(body)
    first, other_question, second_turn = bodies
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    start, end = _image_span(first, tiny_qwen3_5_dir)
    cached = other_question["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == end // BLOCK_SIZE * BLOCK_SIZE and cached > start, (start, end, cached)
    first_prompt = len(first["prompt_token_ids"])
    cached = second_turn["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (first_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE, (first_prompt, cached)


def _checkpoint_weights(model_dir):
    from vlmd.models.loader import iterate_weights

    return list(iterate_weights(model_dir))


def _config(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def test_the_multi_token_prediction_head_is_read_past_and_an_unknown_weight_refused(tiny_qwen3_5_dir):
    """Published checkpoints carry an ``mtp.*`` head (speculative decoding, D107): loaded past;
    a weight the model has no place for is still an error naming it."""
    import torch

    from vlmd_qwen3_5.model import Qwen3_5Model

    weights = _checkpoint_weights(tiny_qwen3_5_dir)
    model = Qwen3_5Model(_config(tiny_qwen3_5_dir))
    model.load_weights([*weights, ("mtp.fc.weight", torch.zeros(64, 128)), ("mtp.norm.weight", torch.zeros(64))])
    with pytest.raises(ValueError, match="layers.0.linear_attn.extra"):
        Qwen3_5Model(_config(tiny_qwen3_5_dir)).load_weights(
            [*weights, ("model.language_model.layers.0.linear_attn.extra", torch.zeros(1))])
    with pytest.raises(ValueError, match="lacks weights"):
        Qwen3_5Model(_config(tiny_qwen3_5_dir)).load_weights(
            [(name, tensor) for name, tensor in weights if not name.endswith("layers.0.linear_attn.A_log")])


def test_the_kv_spec_names_each_linear_attention_layers_state(tiny_qwen3_5_dir):
    """The processing info's spec (``vlmd cost``, from the config alone) equals the model's:
    every decoder layer counted, the full-attention ones paged, each linear-attention one
    holding its state's bytes (the convolution's last 3 inputs of 2 * 2 * 16 + 4 * 16
    channels and 4 delta-rule matrices of 16 x 16, float32)."""
    from vlmd_qwen3_5.kv import kv_spec_for
    from vlmd_qwen3_5.model import Qwen3_5Model

    config = _config(tiny_qwen3_5_dir)
    spec = Qwen3_5Model(config).kv_spec
    assert spec == kv_spec_for(config.text_config)
    state = (128 * 3 + 4 * 16 * 16) * 4
    assert spec.layer_state_bytes == (state, state, state, None, state, state, state, None)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (8, 2, 64)


@pytest.fixture(scope="module")
def split_server(tiny_qwen3_5_dir, tmp_path_factory):
    # Two ranks, each with half of every layer's heads (a Gated DeltaNet layer's state too);
    # a 16-token budget that splits every prompt; 24 blocks, which three image requests
    # at once do not fit (each holds 5 full-attention blocks and 3 state pages at its end).
    server = Server(tiny_qwen3_5_dir, "--tensor-parallel-size", "2", "--torch-threads", "1", "--limit-mm-per-prompt",
                    "image=1,video=0", "--max-num-batched-tokens", "16", "--num-kv-blocks", "24",
                    "--max-model-len", "256", log_dir=tmp_path_factory.mktemp("qwen3-5-tp-logs"))
    yield server
    server.stop()


def test_two_ranks_and_preemption_answer_what_transformers_does(split_server, tiny_qwen3_5_dir):
    """The dense model over two ranks, its states carried across 16-token chunks and computed
    again (or copied from a snapshot) after preemption: every answer transformers'."""
    image = lambda seed, w, h: {"type": "image", "media": random_image(seed, w, h)}  # noqa: E731
    first = ([image(41, 640, 480)], "What is in this image?", {}, None)
    cases = [first, ([], "Write a short poem about the sea.", {}, None), ([image(42, 320, 240)], "Colours?", {}, None),
             ([image(43, 640, 480)], "What is in this image?", {}, None)]
    references = [_reference(tiny_qwen3_5_dir, *case, 24) for case in cases]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: split_server.chat(_body(*case, 24)), cases))
    for (status, body), reference in zip(answers, references):
        assert status == 200, body
        assert_chat_parity(body, reference)
    assert split_server.metrics()["vlmd_num_preemptions_total"] > 0
    status, again = split_server.chat(_body(*first, 24))  # alone, from its snapshot where one is left
    assert status == 200, again
    assert_chat_parity(again, references[0])
