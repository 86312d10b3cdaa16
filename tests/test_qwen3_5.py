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

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Server, random_image
from oracle import assert_chat_parity
from test_qwen3_vl import MEDIA_IO, _body, _reference, decoded_video

CASE_NAMES = ["text_only", "image_640x480", "two_images", "video", "long_text"]
BUDGET = 64  # --max-num-batched-tokens: the chunk a long prompt is split into
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


def _max_tokens(index: int) -> int:
    return 8 + 2 * index


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


def _run_concurrently(server, cases):
    def one(index):
        status, body = server.chat(_body(*cases[index][1], _max_tokens(index)))
        assert status == 200, body
        return body

    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(one, range(len(cases))))


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
