"""A client that goes away mid-request: the engine must abort the request and free its KV blocks.

The tiny model decodes a token in about a millisecond on a CPU, so "freed well before the
request would have finished" is measured in engine steps, which do not depend on the
machine's speed: a request for N tokens that ran to the end would take at least N steps.
"""

from __future__ import annotations

import http.client
import socket
import struct
import time

import orjson
import pytest

from conftest import image_message, random_image

MAX_TOKENS = 1400  # the image prompt is ~590 tokens; --max-model-len 2048
STEPS = "vlmd_engine_steps_total"
FREE = "vlmd_kv_cache_free_blocks"
TOTAL = "vlmd_kv_cache_total_blocks"
RUNNING = "vlmd_num_requests_running"
WAITING = "vlmd_num_requests_waiting"


def wait_until_idle(server, timeout: float = 10.0) -> tuple[dict, float]:
    """Poll /metrics until no request runs or waits and every KV block is free."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        metrics = server.metrics()
        if metrics[RUNNING] == 0 and metrics[WAITING] == 0 and metrics[FREE] == metrics[TOTAL]:
            return metrics, time.monotonic() - started
        if time.monotonic() > deadline:
            pytest.fail(f"the server did not free its KV blocks within {timeout} s: {metrics}")
        time.sleep(0.01)


def wait_until_running(server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if metrics[RUNNING] >= 1 and metrics[FREE] < metrics[TOTAL]:
            return metrics
        if time.monotonic() > deadline:
            pytest.fail(f"the request never started running: {metrics}")
        time.sleep(0.005)


def chat_body(server, *, stream: bool) -> bytes:
    return orjson.dumps({
        "model": server.model,
        "messages": image_message("Tell me a very long story about this picture.", random_image(11, 120, 90)),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    })


def raw_post(server, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def read_sse_events(sock: socket.socket, count: int) -> list[dict]:
    """Read the response head and the first ``count`` SSE data events (chunked encoding
    is left in the buffer: events are found by their ``data: `` lines)."""
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection before answering"
        buffer += chunk
    head, _, buffer = buffer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"text/event-stream" in head, head
    events: list[dict] = []
    while len(events) < count:
        while b"\n\n" not in buffer:
            chunk = sock.recv(65536)
            assert chunk, "the stream ended early"
            buffer += chunk
        event, _, buffer = buffer.partition(b"\n\n")
        data = event[event.index(b"data: ") + len(b"data: "):]
        assert data != b"[DONE]", "the stream finished before the client left"
        events.append(orjson.loads(data))
    return events


def close_abruptly(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a killed client or a dropped connection does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def assert_serves(server) -> None:
    status, body = server.chat({"messages": image_message("hi", random_image(2, 64, 64)), "max_tokens": 3})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 3


@pytest.fixture
def server(llava_server):
    wait_until_idle(llava_server)
    yield llava_server
    assert llava_server.process.poll() is None, "the server died"
    wait_until_idle(llava_server)
    assert_serves(llava_server)


def assert_aborted_early(before: dict, after: dict, seconds: float) -> None:
    steps = after[STEPS] - before[STEPS]
    # Finishing would have taken >= MAX_TOKENS steps (one token per decode step).
    assert steps < MAX_TOKENS / 2, f"{steps} engine steps: the request was not aborted early"
    assert seconds < 10


@pytest.mark.parametrize("close", [socket.socket.close, close_abruptly], ids=["close", "reset"])
def test_streaming_client_disconnects(server, close):
    before = wait_until_idle(server)[0]
    sock = raw_post(server, chat_body(server, stream=True))
    try:
        events = read_sse_events(sock, 4)
    except BaseException:
        sock.close()
        raise
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"
    assert any(e["choices"][0]["delta"].get("content") for e in events[1:]), events  # tokens were flowing
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    close(sock)
    after, seconds = wait_until_idle(server)
    assert_aborted_early(before, after, seconds)


@pytest.mark.parametrize("close", [socket.socket.close, close_abruptly], ids=["close", "reset"])
def test_non_streaming_client_abandons_request(server, close):
    before = wait_until_idle(server)[0]
    sock = raw_post(server, chat_body(server, stream=False))
    try:
        wait_until_running(server)
    finally:
        close(sock)
    after, seconds = wait_until_idle(server)
    assert_aborted_early(before, after, seconds)


def test_http_client_closes_mid_stream(server):
    """The same through http.client, reading a few lines of the body and closing."""
    before = wait_until_idle(server)[0]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", chat_body(server, stream=True),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        lines = [response.readline() for _ in range(6)]
        assert any(line.startswith(b"data: ") for line in lines), lines
    finally:
        conn.close()
    after, seconds = wait_until_idle(server)
    assert_aborted_early(before, after, seconds)


def test_disconnect_does_not_disturb_a_concurrent_request(server):
    """Aborting one request frees only its own blocks: a neighbour finishes in full."""
    neighbour_body = orjson.loads(chat_body(server, stream=False))
    neighbour_body["max_tokens"] = 400
    neighbour = raw_post(server, orjson.dumps(neighbour_body))
    leaver = raw_post(server, chat_body(server, stream=True))
    try:
        read_sse_events(leaver, 3)
    finally:
        close_abruptly(leaver)
    neighbour.settimeout(60)
    response = b""
    while True:
        chunk = neighbour.recv(65536)
        if not chunk:
            break
        response += chunk
        head, _, body = response.partition(b"\r\n\r\n")
        length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
        if length and len(body) >= length[0]:
            break
    neighbour.close()
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), response[:500]
    completion = orjson.loads(body)
    assert completion["usage"]["completion_tokens"] == 400
    assert completion["choices"][0]["finish_reason"] == "length"
