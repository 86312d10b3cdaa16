"""A poisoned request fails alone, over HTTP, and a bounded fault-and-load soak.

The server runs with the test-only fault injection (vlmd/testing/faults.py, installed by
the launcher conftest.Server starts it with): the image encoder raises for a solid-grey-13 image and the decoder
forward raises, after writing K/V, for a batch holding ``<pad>``. Chunked prefill (256
tokens per step, an image is 576) and preemption (64 KV blocks, an image request needs ~38)
are active. Good answers must equal transformers' greedy tokens.
"""

from __future__ import annotations

import json
import threading

import pytest
from PIL import Image

import oracle
from conftest import Server, assert_error, image_message, random_image
from vlmd.testing.soak import POISON_PIXEL, POISON_TEXT, run_soak

FAULTS = {"encoder_pixel_value": POISON_PIXEL, "forward_token_id": 4095}  # 4095 = <pad>
FLAGS = ("--max-model-len", "1024", "--max-num-batched-tokens", "256", "--num-kv-blocks", "64",
         "--mm-processor-cache-gb", "0.05", "--max-request-bytes", str(8 * 2**20))
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def faulty_server(tiny_llava_dir, tmp_path_factory):
    server = Server(tiny_llava_dir, *FLAGS, faults=FAULTS, log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def hf_messages(text: str, with_image: bool) -> list[dict]:
    if not with_image:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def test_poisoned_requests_fail_alone_and_good_ones_match_transformers(faulty_server, tiny_llava_dir):
    server = faulty_server
    good = [(f"Describe picture {i}.", random_image(30 + i, 100 + 10 * i, 80)) for i in range(4)]
    good.append(("Tell me about quartz.", None))
    poisoned_image = Image.new("RGB", (72, 72), (POISON_PIXEL,) * 3)
    bodies = [{"messages": image_message(text, image) if image else [{"role": "user", "content": text}]}
              for text, image in good]
    bodies.append({"messages": image_message("Describe it.", poisoned_image)})
    bodies.append({"messages": [{"role": "user", "content": POISON_TEXT}]})
    before = server.metrics()
    results: list = [None] * len(bodies)

    def send(index: int) -> None:
        results[index] = server.chat({**bodies[index], "max_tokens": MAX_TOKENS, "temperature": 0,
                                      "return_token_ids": True})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    for (text, image), (status, body) in zip(good, results):
        assert status == 200, body
        ref = oracle.hf_llava_generate(tiny_llava_dir, hf_messages(text, image is not None),
                                       [image] if image else [], MAX_TOKENS)
        oracle.assert_greedy_match(body["choices"][0]["token_ids"], ref)
    for status, body in results[len(good):]:
        error = assert_error(status, body, 500, "engine failed", "request id chatcmpl-")
        assert error["type"] == "server_error"
    after = server.metrics()
    assert after["vlmd_failed_steps_total"] > before["vlmd_failed_steps_total"]
    assert after["vlmd_requests_failed_in_step_total"] - before["vlmd_requests_failed_in_step_total"] == 2
    assert after["vlmd_num_preemptions_total"] > before["vlmd_num_preemptions_total"], "preemption was not exercised"

    # The engine keeps serving: the same good image again, same tokens.
    status, body = server.chat({**bodies[0], "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True})
    assert status == 200 and body["choices"][0]["token_ids"] == results[0][1]["choices"][0]["token_ids"]


def test_short_soak(faulty_server):
    """Good requests, disconnects, bad media, wrong JSON shapes, oversize bodies and the
    injected faults for at most 400 requests or 30 s: every answer as expected (no 5xx but
    the injected ones), a drained engine, bounded RSS, no traceback for a disconnect."""
    server = faulty_server
    log_size = server.log_path.stat().st_size
    result = run_soak(server.url, server.process.pid, server.model, max_requests=400, max_seconds=30,
                      clients=6, max_request_bytes=8 * 2**20)
    summary = result.summary()
    print(json.dumps(summary))
    assert result.unexpected == [], summary
    assert result.drained, summary
    assert result.rss_after - result.rss_idle < 2**30, summary
    statuses = {status for (_, status) in result.outcomes}
    assert statuses <= {200, 400, 413, 500}, summary
    fives = {name for (name, status) in result.outcomes if status == 500}
    assert fives <= {"poison-encoder", "poison-forward"}, summary
    with open(server.log_path, "rb") as log:
        log.seek(log_size)
        tail = log.read().decode(errors="replace")
    assert "Error handling request" not in tail and "ConnectionResetError" not in tail
