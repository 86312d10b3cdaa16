"""The vLLM-named gauges a Kubernetes inference gateway routes on (Gateway API Inference
Extension's model-server protocol: llm-d, KServe, AIBrix), scraped from a real server.

One running slot (``--max-num-seqs 1``) makes a second request wait, so queued and running
requests are states the test can hold still: two long requests are sent, the scrape must
show one running and one waiting with KV blocks in use, and both figures must fall back to
zero once the clients leave (their requests are aborted, their blocks freed).
"""

from __future__ import annotations

import socket
import time

import orjson
import pytest

from conftest import Server, image_message, random_image

MODEL = "gateway-llava"
LABELS = f'{{engine="0",model_name="{MODEL}"}}'  # as the exposition format sorts them
RUNNING = "vllm:num_requests_running" + LABELS
WAITING = "vllm:num_requests_waiting" + LABELS
KV_USAGE = "vllm:kv_cache_usage_perc" + LABELS
GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc" + LABELS
# Enough tokens that neither request can finish while the test looks (one decode step a
# token: at least 1,400 steps); the clients leave and the server aborts both.
MAX_TOKENS = 1400


@pytest.fixture(scope="module")
def server(tiny_llava_dir, tmp_path_factory):
    server = Server(tiny_llava_dir, "--max-num-seqs", "1", "--max-model-len", "2048", name=MODEL,
                    log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def long_request(server, seed: int) -> socket.socket:
    body = orjson.dumps({
        "model": server.model, "messages": image_message("Tell me a very long story.", random_image(seed, 120, 90)),
        "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
    })
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def scrape_until(server, predicate, what: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if predicate(metrics):
            return metrics
        if time.monotonic() > deadline:
            pytest.fail(f"{what} never showed in /metrics: "
                        f"{ {k: v for k, v in metrics.items() if 'request' in k or 'kv_cache' in k} }")
        time.sleep(0.005)


def assert_vllm_names_agree_with_ours(metrics: dict) -> None:
    """The same snapshot under both names: vLLM's gauges are vlmd's figures, relabelled."""
    assert metrics[RUNNING] == metrics["vlmd_num_requests_running"]
    assert metrics[WAITING] == metrics["vlmd_num_requests_waiting"]
    assert metrics[KV_USAGE] == metrics["vlmd_kv_cache_usage_perc"]
    assert metrics[GPU_CACHE_USAGE] == metrics[KV_USAGE]


def test_the_scrape_declares_the_gauges_vllm_declares(server):
    _, raw = server.request("GET", "/metrics")
    text = raw.decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        assert f"# TYPE {name} gauge" in text, name


def test_vllm_named_gauges_move_with_queued_and_running_requests_and_kv_usage(server):
    idle = scrape_until(server, lambda m: m[RUNNING] == 0 and m[WAITING] == 0 and m[KV_USAGE] == 0, "an idle server")
    assert_vllm_names_agree_with_ours(idle)
    first = long_request(server, 1)
    second = None
    try:
        alone = scrape_until(server, lambda m: m[RUNNING] == 1 and m[KV_USAGE] > 0, "the first request running")
        second = long_request(server, 2)
        busy = scrape_until(server, lambda m: m[RUNNING] == 1 and m[WAITING] == 1, "one running, one waiting")
        assert_vllm_names_agree_with_ours(alone)
        assert_vllm_names_agree_with_ours(busy)
        # A fraction of the blocks, as vLLM exports it (1 means every block is in use).
        used = 1 - busy["vlmd_kv_cache_free_blocks"] / busy["vlmd_kv_cache_total_blocks"]
        assert 0 < busy[KV_USAGE] <= 1
        assert busy[KV_USAGE] == pytest.approx(used, abs=1 / busy["vlmd_kv_cache_total_blocks"])
    finally:
        first.close()
        if second is not None:
            second.close()
    after = scrape_until(server, lambda m: m[RUNNING] == 0 and m[WAITING] == 0 and m[KV_USAGE] == 0,
                         "both requests aborted and their blocks freed")
    assert_vllm_names_agree_with_ours(after)
