"""A request's time to first token, stage by stage (issue 47, D109), through a real server.

The stages are spans between stamps on one clock, so for one request at a time the stage
histograms' sums grow by exactly what the time-to-first-token histogram's sum grows (a
float identity, no wall-clock bound), every stage's count by one, and the log line of
``--log-request-stages`` shows each stage non-negative. A small step budget
(``--max-num-batched-tokens 256``) splits an image's prompt into chunks: their count is
the prompt's tokens over the budget, rounded up; beside a request that decodes, over
``--long-prefill-step-tokens`` (D119).
"""

from __future__ import annotations

import math

import orjson
import pytest

from conftest import Server, image_message, random_image
from test_disconnect import RUNNING, raw_post, read_sse_events, wait_until_idle
from vlmd.server.stages import STAGES

BUDGET = 256
LONG_PREFILL_BOUND = 64  # a step's long prefill tokens while another request is in the engine


@pytest.fixture(scope="module")
def server(tiny_llava_dir, tmp_path_factory):
    server = Server(tiny_llava_dir, "--log-request-stages", "--max-num-batched-tokens", str(BUDGET),
                    "--long-prefill-step-tokens", str(LONG_PREFILL_BOUND),
                    "--max-num-encoder-input-tokens", "1024", "--encoder-cache-size", "1024",
                    "--max-model-len", "2048", "--no-warmup", name="stages-llava",
                    log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def stage_key(stage: str, kind: str, suffix: str) -> str:
    return f'vlmd_request_stage_seconds_{suffix}{{input="{kind}",stage="{stage}"}}'


def grown(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def stage_line(server: Server, request_id: str) -> dict:
    for line in server.log_path.read_text().splitlines():
        if '"request stages"' in line and f'"{request_id}-0"' in line:
            return orjson.loads(line)
    pytest.fail(f"no stage line for {request_id} in the log")


def check_one_request(server: Server, body: dict, kind: str) -> tuple[dict, dict]:
    before = server.metrics()
    status, answer = server.chat({**body, "max_tokens": 2, "temperature": 0})
    assert status == 200, answer
    after = server.metrics()
    for stage in STAGES:
        assert grown(before, after, stage_key(stage, kind, "count")) == 1, stage
    stages_total = sum(grown(before, after, stage_key(stage, kind, "sum")) for stage in STAGES)
    ttft = grown(before, after, "vlmd_time_to_first_token_seconds_sum")
    assert ttft > 0
    assert abs(stages_total - ttft) <= 1e-6 * (1 + ttft), (stages_total, ttft)
    line = stage_line(server, answer["id"])
    assert line["input"] == kind
    for stage in STAGES:
        assert line[f"{stage}_ms"] >= 0, (stage, line)
    return answer, line


def test_an_image_request_s_stages_add_up_to_its_time_to_first_token(server):
    before = server.metrics()
    answer, line = check_one_request(server, {"messages": image_message("What is it?", random_image(7, 96, 72))},
                                     "media")
    after = server.metrics()
    chunks = math.ceil(answer["usage"]["prompt_tokens"] / BUDGET)
    assert chunks >= 3  # 576 placeholders and the text
    assert line["prefill_chunks"] == chunks
    assert grown(before, after, 'vlmd_prefill_chunk_seconds_count{input="media"}') == chunks
    for stage in ("render", "fetch", "decode", "process", "encoder", "prefill"):
        assert line[f"{stage}_ms"] > 0, (stage, line)


def test_an_image_prompt_beside_a_decode_takes_the_long_prefill_bound_a_step(server):
    """D119: while a text request decodes (its stream held open), an image prompt's chunks
    take 64 tokens a step; alone (the first test) the same prompt took 256."""
    wait_until_idle(server)
    decoding = {"model": server.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1800,
                "ignore_eos": True, "temperature": 0, "stream": True}
    sock = raw_post(server, orjson.dumps(decoding))
    try:
        read_sse_events(sock, 2)  # its first token: it decodes from now on
        answer, line = check_one_request(
            server, {"messages": image_message("What is it?", random_image(8, 96, 72))}, "media")
        # Still decoding (1,800 steps): it shared every step of the image prompt's prefill.
        assert server.metrics()[RUNNING] == 1
    finally:
        sock.close()
    wait_until_idle(server)
    assert line["prefill_chunks"] == math.ceil(answer["usage"]["prompt_tokens"] / LONG_PREFILL_BOUND) >= 9


def test_a_text_request_has_no_media_stages(server):
    answer, line = check_one_request(server, {"messages": [{"role": "user", "content": "hello"}]}, "text")
    assert line["prefill_chunks"] == 1
    for stage in ("fetch", "decode", "encoder"):
        assert line[f"{stage}_ms"] == 0, (stage, line)
    assert line["render_ms"] > 0 and line["prefill_ms"] > 0


def test_a_step_encodes_one_largest_item_by_default(llava_server):
    """D110: without --max-num-encoder-input-tokens a step's encoder work is one largest item
    (576 tokens for LLaVA), so two images are encoded in two steps, each step's encoder time
    observed once."""
    before = llava_server.metrics()
    status, answer = llava_server.chat({"messages": image_message("Compare.", random_image(11, 96, 72),
                                                                  random_image(12, 96, 72)),
                                        "max_tokens": 1, "temperature": 0})
    assert status == 200, answer
    after = llava_server.metrics()
    assert grown(before, after, "vlmd_encoder_forwards_total") == 2
    assert grown(before, after, "vlmd_encoder_forward_seconds_count") == 2


@pytest.mark.parametrize("messages, media", [
    ([{"role": "user", "content": "hello"}], False),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], False),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
     True),
    ([{"role": "user", "content": [{"type": "image_embeds", "image_embeds": "x"}]}], True),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], True),
    ([{"role": "user", "content": ["not a part"]}], True),
    ("not a list", True),
])
def test_which_requests_wait_for_a_media_thread(messages, media):
    from vlmd.processing.preprocess import InputPreprocessor

    assert InputPreprocessor.holds_media(messages) is media
