"""Clients that cannot hold a connection forever (issue 36, item 3): a body that does not
arrive within --request-read-timeout (plus the time its bytes buy at --request-min-body-rate)
is a 408 and the connection closes, a large one arriving faster than that rate is read; an idle keep-alive
connection is closed after --keepalive-timeout; a good request beside them is answered."""

from __future__ import annotations

import socket
import time

import orjson
import pytest

from conftest import Server

READ_TIMEOUT_S, KEEPALIVE_S = 1.0, 1.0


@pytest.fixture(scope="module")
def server(tiny_llava_dir, tmp_path_factory):
    server = Server(tiny_llava_dir, "--request-read-timeout", str(READ_TIMEOUT_S), "--keepalive-timeout",
                    str(KEEPALIVE_S), "--no-warmup", log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout
    bounds the wait: a server that never closes fails the test, it does not hang it)."""
    received = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return received
        received += chunk


def test_a_body_that_stops_arriving_is_a_408_and_the_connection_closes(server):
    body = orjson.dumps({"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    with _connect(server) as sock:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body) + 1000}\r\n\r\n").encode()
        sock.sendall(head + body)  # 1000 bytes short, and then silence
        # Meanwhile a good request is answered.
        status, answer = server.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200, answer
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"--request-read-timeout" in reply


def test_a_large_declared_body_that_never_arrives_is_cut_off_at_the_base_deadline(server):
    # 64 MiB declared (the largest body), nothing sent: the deadline credits bytes received,
    # not bytes declared, so this is a 408 after --request-read-timeout (1 s), not after the
    # ~17 minutes the declared size would buy at --request-min-body-rate. The socket's 30 s
    # timeout bounds the wait: a server that credits the declaration fails the test.
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {64 * 2**20}\r\n\r\n".encode())
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"1 s (--request-read-timeout)" in reply


def test_a_trickled_body_is_cut_off_at_the_deadline(server):
    # 10 bytes at a time, each after waiting up to 0.2 s for an answer: at most 6,000 of the
    # 100,000 bytes promised ever arrive, so only the read deadline can end this with a
    # reply (the count bounds the test, not its time: a server that waits fails it).
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n")
        sock.settimeout(0.2)
        reply = b""
        for _ in range(600):
            try:
                sock.sendall(b" " * 10)
                reply = sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:  # closed under us: what it sent first is read below
                break
            if reply:
                break
        sock.settimeout(30)
        reply += _read_until_closed(sock)  # and the server closes the connection
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_a_large_body_arriving_above_the_minimum_rate_outlives_the_base_deadline(server):
    """2 MB of leading spaces (not a run the text scan refuses) then the request: 90 % at
    once, a pause of twice --request-read-timeout, the rest. The bytes sent first bought ~27 s
    at the default 64 KiB/s, so the pause is well inside the deadline even on a loaded host; a
    fixed one-second deadline would have cut it off."""
    request = orjson.dumps({"model": server.model, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2})
    body = b" " * 2_000_000 + request
    split = int(len(body) * 0.9)
    with _connect(server) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body[:split])
        time.sleep(2 * READ_TIMEOUT_S)
        sock.sendall(body[split:])
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]


def test_an_idle_keep_alive_connection_is_closed(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        assert _read_until_closed(sock) == b""  # closed by the server after KEEPALIVE_S idle


def test_trickled_headers_are_cut_off_by_the_keep_alive_deadline(server):
    """A request whose headers never end: aiohttp (3.14) arms the keep-alive timer when a
    connection opens and does not re-arm it on partial data, so --keepalive-timeout is also
    the header-read deadline. One header line every 0.1-0.2 s: 600 of them would take over a
    minute; the server must close long before the count runs out."""
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(0.1)
        closed = False
        for index in range(600):
            try:
                sock.sendall(f"X-Trickle-{index}: 1\r\n".encode())
                if sock.recv(65536) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except OSError:  # reset under us: closed
                closed = True
                break
    assert closed, "the server kept a connection whose headers never ended"
