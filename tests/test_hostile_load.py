"""Hostile load over HTTP: huge text bodies, media that pass their own bounds but not
together, and the answers at each bound (400 / 413 / 503 with Retry-After).

The server here runs with default flags (its own process, so its RSS is ours to measure).
"""

from __future__ import annotations

import threading
import time
import urllib.request

import orjson
import pytest

from conftest import Server, image_data_url, image_message, random_image
from test_bad_input import assert_error
from vlmd.testing.soak import rss_bytes

MB = 2**20


@pytest.fixture(scope="module")
def default_server(tiny_llava_dir, tmp_path_factory):
    server = Server(tiny_llava_dir, log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def timed_post(server, body: bytes, results: list, index: int, timeout: float = 60.0) -> None:
    began = time.monotonic()
    status, raw = server.request("POST", "/v1/chat/completions", body, timeout=timeout)
    results[index] = (status, raw, time.monotonic() - began)


class RssSampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.running = pid, rss_bytes(pid), True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.01)


def test_four_40mb_text_bodies_beside_a_good_image(default_server):
    server = default_server
    good = orjson.dumps({"model": server.model, "messages": image_message("Describe it.", random_image(5, 96, 64)),
                         "max_tokens": 4, "temperature": 0})
    status, _ = server.request("POST", "/v1/chat/completions", good)  # warm: first-image costs out of the timing
    assert status == 200
    idle = rss_bytes(server.process.pid)
    word = "a" * (40 * MB)
    huge = orjson.dumps({"model": server.model, "messages": [{"role": "user", "content": word}]})
    assert len(huge) > 40 * MB
    sampler = RssSampler(server.process.pid)
    sampler.start()
    results: list = [None] * 5
    threads = [threading.Thread(target=timed_post, args=(server, huge, results, i)) for i in range(4)]
    threads.append(threading.Thread(target=timed_post, args=(server, good, results, 4)))
    for thread in threads:
        thread.start()
    health_seconds = []
    while any(thread.is_alive() for thread in threads):  # /health and /metrics answer under the flood
        began = time.monotonic()
        for path in ("/health", "/metrics"):
            with urllib.request.urlopen(server.url + path, timeout=5) as response:
                assert response.status == 200
        health_seconds.append(time.monotonic() - began)
    for thread in threads:
        thread.join()
    sampler.running = False
    sampler.join()
    for status, raw, seconds in results[:4]:
        assert_error(status, raw, 400, "characters", "max_model_len", "2048")
        assert seconds < 2.0, f"a 40 MB body took {seconds:.2f} s to refuse"
    status, raw, seconds = results[4]
    assert status == 200, raw
    assert seconds < 2.0, f"the good image request took {seconds:.2f} s beside the flood"
    figures = {"refuse_s": [round(r[2], 3) for r in results[:4]], "good_image_s": round(seconds, 3),
               "rss_idle_mb": idle // MB, "rss_peak_mb": sampler.peak // MB,
               "health_metrics_max_s": round(max(health_seconds), 3)}
    print(orjson.dumps(figures).decode())
    assert sampler.peak - idle < 1024 * MB, figures
    assert max(health_seconds) < 2.0, figures


def test_text_bound_names_both_numbers(llava_server):
    # The tiny tokenizer's longest entry is 15 characters: 2048 tokens hold at most 30720.
    status, body = llava_server.chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "b" * 20000}, {"type": "text", "text": "c" * 20000}]}]})
    error = assert_error(status, body, 400, "40000 characters", "30720", "2048", param="messages")
    assert "15" in error["message"]


def test_many_empty_parts_are_refused_before_the_template(llava_server):
    # A million of them held a preprocessing thread for 6 s in the template before this bound.
    # (60,000 parts: ~180,000 JSON values, under --max-request-json-values, so the body is parsed.)
    status, body = llava_server.chat({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 60_000}]})
    assert_error(status, body, 400, "60001 messages and content parts", "2048")


def test_text_under_the_character_bound_is_still_checked_in_tokens(llava_server):
    status, body = llava_server.chat({"messages": [{"role": "user", "content": "zebra " * 5000}]})
    assert_error(status, body, 400, "tokens", "max_model_len is 2048")


def test_media_budget_413_for_an_item_larger_than_the_budget(tiny_llava_dir, tmp_path_factory):
    # 0.0005 GiB = 536870 bytes: a 640x480 RGB image decodes to 921600.
    server = Server(tiny_llava_dir, "--max-inflight-media-gb", "0.0005", "--no-warmup",
                    log_dir=tmp_path_factory.mktemp("logs"))
    try:
        status, body = server.chat({"messages": image_message("hi", random_image(1, 640, 480)), "max_tokens": 2})
        assert_error(status, body, 413, "921600 bytes", "--max-inflight-media-gb")
        status, body = server.chat({"messages": image_message("hi", random_image(1, 96, 64)), "max_tokens": 2})
        assert status == 200, body
        assert server.metrics()["vlmd_inflight_media_bytes"] == 0
    finally:
        server.stop()


def test_preprocess_timeout(tiny_llava_dir, tmp_path_factory):
    """A preprocess deadline of 1 ms: the work is abandoned and the client gets 503 with
    Retry-After; the server keeps answering."""
    server = Server(tiny_llava_dir, "--preprocess-timeout", "0.001", "--no-warmup",
                    log_dir=tmp_path_factory.mktemp("logs"))
    try:
        body = orjson.dumps({"model": server.model, "messages": image_message("hi", random_image(1, 640, 480)),
                             "max_tokens": 2})
        request = urllib.request.Request(server.url + "/v1/chat/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 503
        assert info.value.headers["Retry-After"] == "1"
        assert_error(503, info.value.read(), 503, "--preprocess-timeout")
        assert server.metrics()["vlmd_preprocess_timeouts_total"] >= 1
        # The abandoned pool thread stops at its next stage boundary, after the client was
        # answered, so the gauge reaches 0 shortly after the 503, not necessarily before it.
        deadline = time.monotonic() + 15
        while server.metrics()["vlmd_preprocess_in_flight"] != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.metrics()["vlmd_preprocess_in_flight"] == 0
    finally:
        server.stop()


def test_overload_503_with_retry_after(tiny_llava_dir, tmp_path_factory):
    server = Server(tiny_llava_dir, "--max-waiting-requests", "1", "--max-num-seqs", "1", "--no-warmup",
                    log_dir=tmp_path_factory.mktemp("logs"))
    try:
        long_body = orjson.dumps({"model": server.model, "messages": [{"role": "user", "content": "story"}],
                                  "max_tokens": 1500, "ignore_eos": True})
        results: list = [None] * 6
        threads = [threading.Thread(target=timed_post, args=(server, long_body, results, i)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        statuses = sorted(status for status, _, _ in results)
        assert 200 in statuses and 503 in statuses, statuses
        for status, raw, _ in results:
            if status == 503:
                assert_error(status, raw, 503, "--max-waiting-requests")
        assert server.metrics()["vlmd_requests_overloaded_total"] >= 1
    finally:
        server.stop()


def test_hostile_bodies_of_every_shape(llava_server):
    """JSON shapes and media the parser must refuse cleanly (beyond test_bad_input's)."""
    cases = [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 7}}]}]}, 400),
        ({"messages": [{"role": "user", "content": [[]]}]}, 400),
        ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, 400),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": image_data_url(random_image(1, 32, 32)).replace("image/png", "image/svg+xml")}}]}]}, None),
    ]
    for body, expected in cases:
        status, answer = llava_server.chat({**body, "max_tokens": 2})
        if expected is None:
            assert status in (200, 400), answer
        else:
            assert_error(status, answer, expected)
