"""The chat API's behaviour through the front door: streaming, usage, stop strings,
logprobs, seeded sampling, min_tokens, models and auth."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import urllib.request

import orjson
import pytest

from conftest import Server, free_port, image_message, random_image
from vlmd.config import CACHE_DIR_ENV, cache_dir


def _stream_events(server: Server, body: dict) -> list[dict]:
    status, raw = server.request("POST", "/v1/chat/completions", orjson.dumps({"model": server.model, **body, "stream": True}))
    assert status == 200, raw
    events = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [orjson.loads(event) for event in events[:-1]]


def test_stream_and_non_stream_agree(llava_server):
    body = {"messages": image_message("Describe it.", random_image(1)), "max_tokens": 24, "temperature": 0,
            "return_token_ids": True}
    status, full = llava_server.chat(body)
    assert status == 200
    events = _stream_events(llava_server, {**body, "stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["prompt_token_ids"] == full["prompt_token_ids"]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    token_ids = [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids") or []]
    assert text == full["choices"][0]["message"]["content"]
    assert token_ids == full["choices"][0]["token_ids"]
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == []
    # The second, identical request is served from the prefix cache: it says so. It finds
    # every full block of its prompt but the one holding the last token, which is computed
    # (kv_manager: at most (prompt - 1) // block tokens); the first found fewer, in blocks.
    prompt_tokens = len(full["prompt_token_ids"])
    block = 16  # --block-size's default, the shared server's
    cached_second = usage["prompt_tokens_details"]["cached_tokens"]
    cached_first = full["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached_second == (prompt_tokens - 1) // block * block
    assert cached_second >= 576  # the image's placeholders, at least
    assert cached_first % block == 0 and cached_first < cached_second
    usage["prompt_tokens_details"] = full["usage"]["prompt_tokens_details"]
    assert usage == full["usage"]
    assert usage["completion_tokens"] == 24
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24


def test_stop_string_cuts_text_and_finishes(llava_server):
    body = {"messages": image_message("Go on.", random_image(2)), "max_tokens": 40, "temperature": 0}
    _, full = llava_server.chat(body)
    text = full["choices"][0]["message"]["content"]
    assert len(text) > 12
    stop = text[6:9]
    expected = text[: text.index(stop)]
    _, cut = llava_server.chat({**body, "stop": [stop, "never-appears-xyz"]})
    assert cut["choices"][0]["message"]["content"] == expected
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] < 40
    events = _stream_events(llava_server, {**body, "stop": stop})
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert streamed == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_describe_the_greedy_choice(llava_server):
    body = {"messages": image_message("What?", random_image(3)), "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "return_token_ids": True}
    status, full = llava_server.chat(body)
    assert status == 200
    content = full["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 3
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        assert entry["logprob"] == pytest.approx(top[0]["logprob"])  # greedy picks the top token
        assert entry["logprob"] <= 0 and math.isfinite(entry["logprob"])


def test_seeded_sampling_is_reproducible(llava_server):
    body = {"messages": image_message("Tell a story.", random_image(4)), "max_tokens": 20, "temperature": 1.0,
            "top_p": 0.9, "top_k": 50, "return_token_ids": True}
    first = [llava_server.chat({**body, "seed": 7})[1]["choices"][0]["token_ids"] for _ in range(2)]
    other = llava_server.chat({**body, "seed": 8})[1]["choices"][0]["token_ids"]
    greedy = llava_server.chat({**body, "temperature": 0})[1]["choices"][0]["token_ids"]
    assert first[0] == first[1]
    assert other != first[0]
    assert greedy != first[0]


def test_stop_token_ids_and_min_tokens(llava_server):
    body = {"messages": image_message("Say something.", random_image(5)), "max_tokens": 12, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    first_token = llava_server.chat(body)[1]["choices"][0]["token_ids"][0]
    _, stopped = llava_server.chat({**body, "stop_token_ids": [first_token]})
    assert stopped["choices"][0]["token_ids"] == [first_token]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    # Until min_tokens, stop tokens are masked out of sampling: the greedy first token changes.
    _, held = llava_server.chat({**body, "stop_token_ids": [first_token], "min_tokens": 4})
    tokens = held["choices"][0]["token_ids"]
    assert len(tokens) >= 4 and first_token not in tokens[:4]


def test_models_and_health(llava_server):
    status, raw = llava_server.request("GET", "/v1/models")
    assert status == 200
    data = orjson.loads(raw)["data"]
    assert [m["id"] for m in data] == [llava_server.model]
    assert llava_server.request("GET", "/health")[0] == 200


def test_api_key_guards_every_route_but_health(tiny_llava_dir, tmp_path):
    server = Server(tiny_llava_dir, "--api-key", "sekret", "--no-warmup", log_dir=tmp_path)
    try:
        assert server.request("GET", "/health")[0] == 200
        status, raw = server.request("GET", "/v1/models")
        assert status == 401 and orjson.loads(raw)["error"]["type"] == "authentication_error"
        assert server.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert server.request("GET", "/v1/models", headers={"Authorization": "Bearer sekret"})[0] == 200
    finally:
        server.stop()


def test_serve_without_a_model_builds_and_serves_the_embedded_default(tmp_path):
    port = free_port()
    env = {**os.environ, CACHE_DIR_ENV: str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "serve.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "vlmd", "serve", "--port", str(port)], env=env,
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as response:
                    models = orjson.loads(response.read())
                break
            except OSError:
                assert time.monotonic() < deadline, "the default server did not start"
                time.sleep(0.3)
        assert models["data"][0]["id"] == "vlmd-tiny-llava"
        assert (cache_dir(env) / "models" / "tiny-llava-seed0" / "config.json").exists()
    finally:
        process.terminate()
        process.wait(15)
        log.close()


def test_bfloat16_serves_an_image_chat_through_the_native_products(tiny_llava_dir, tmp_path):
    # bfloat16 decode products take vlmd's bfloat16 reader where oneDNN packs bfloat16
    # (tests/test_native_linear.py checks its arithmetic); here the whole server runs on it.
    server = Server(tiny_llava_dir, "--dtype", "bfloat16", "--linear-kernels", "native", "--no-warmup",
                    log_dir=tmp_path)
    try:
        status, body = server.chat({"messages": image_message("Describe it.", random_image(7)), "max_tokens": 6,
                                    "ignore_eos": True, "temperature": 0})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 6
        assert body["choices"][0]["finish_reason"] == "length"
        # The fused decode step reads bfloat16 panels (float32 rows): every decode takes it,
        # on AVX2 hosts too (vlmd builds the panels where oneDNN cannot pack bfloat16).
        metrics = server.metrics()
        assert metrics['vlmd_decode_steps_total{path="fused"}'] == 5
        assert metrics['vlmd_decode_steps_total{path="modules"}'] == 0
    finally:
        server.stop()


def _time_to_first_chunk(server: Server, path: str, body: dict) -> float:
    """Seconds from sending a streaming request to reading its first ``data:`` line (the
    whole stream is then read to its end)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        started = time.perf_counter()
        connection.request("POST", path, orjson.dumps({"model": server.model, **body, "stream": True}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        while not response.readline().startswith(b"data: "):
            pass
        first = time.perf_counter() - started
        response.read()
        return first
    finally:
        connection.close()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story. " * 150}]}),
    ("/v1/completions", {"prompt": "Tell me a long story about a lighthouse keeper. " * 70, "echo": True}),
])
def test_no_chunk_leaves_before_the_first_token_exists(llava_server, path, body):
    # Nothing is streamed before the prefill step has made the first token (as vLLM does),
    # so a client that stamps time to first token at the first chunk (vLLM's benchmark)
    # measures the prefill. The engine records a step before it hands out its tokens, so
    # the prefill steps' own time is a lower bound of the time to the first chunk.
    before = llava_server.metrics()
    first = _time_to_first_chunk(llava_server, path, {**body, "max_tokens": 3, "temperature": 0})
    after = llava_server.metrics()
    name = 'vlmd_engine_step_seconds_sum{kind="prefill"}'
    prefill = after[name] - before.get(name, 0.0)
    assert prefill > 0
    assert first >= prefill, (first, prefill)
