"""A bound on open connections (issue 36 item 3, D85): past --max-connections a request is a
503 (or the connection is closed as accepted), never a stall of the rest; /health and
/metrics answer while the bound is reached; idle keep-alive connections are closed.

The three tiers are checked in-process on a small app (no model: a headroom of one, states
read from the bound itself); the real server is then filled with connections whose bodies
never finish, and emptied again."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import orjson
import pytest
from aiohttp import web

from conftest import Server
from vlmd.server.connections import BoundedSockSite, ConnectionBound

BOUND = 100
IDLE_S = 2.0  # --keepalive-timeout of the real server


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=60)


def _read_until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes (a reset after a reply counts as the close);
    the socket's timeout bounds the wait: a server that never closes fails the test."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def _get(port: int, path: str) -> bytes:
    with _connect(port) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        return _read_until_closed(sock)


def _wait_for(condition, polls: int = 2000) -> bool:
    """Poll ``condition`` up to ``polls`` times (a count, not a clock: 10 ms apart)."""
    for _ in range(polls):
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture
def small_app():
    """An app behind ConnectionBound(2, headroom 1) on its own loop thread; idle connections
    stay open (keep-alive 60 s), so each tier holds still while it is looked at."""
    async def ok(request):
        return web.Response(text="ok")

    bound = ConnectionBound(2, headroom=1)
    app = web.Application(middlewares=[bound.middleware()])
    app.router.add_get("/health", ok)
    app.router.add_get("/work", ok)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, keepalive_timeout=60, access_log=None)

    async def start():
        await runner.setup()
        await BoundedSockSite(runner, listener, bound, backlog=16).start()

    loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield bound, listener.getsockname()[1]
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


def test_the_three_tiers(small_app):
    bound, port = small_app
    held = [_connect(port), _connect(port)]  # the bound, idle
    assert _wait_for(lambda: bound.open == 2)
    # The headroom: anything but a monitoring route is a 503 naming the flag, and closes.
    reply = _get(port, "/work")
    assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
    assert b"Retry-After: 1" in reply and b"--max-connections" in reply
    error = orjson.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == 503
    reply = _get(port, "/health")  # answered, then closed: the slot is for the next monitor
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok"), reply[:200]
    # Past the headroom: refused as accepted, while the held ones are still served.
    idle_monitor = _connect(port)
    assert _wait_for(lambda: bound.open == 3)
    refused = _get(port, "/health")
    assert refused == b"" or refused.startswith(b"HTTP/1.1 503"), refused[:200]
    assert bound.refused == 1 and bound.open == 3
    held[0].sendall(b"GET /work HTTP/1.1\r\nHost: x\r\n\r\n")
    assert held[0].recv(65536).startswith(b"HTTP/1.1 200")  # a connection within the bound is untouched
    # Closed connections are uncounted, and new ones served again.
    for sock in (*held, idle_monitor):
        sock.close()
    assert _wait_for(lambda: bound.open == 0 and not bound.over_bound)
    assert _get(port, "/work").startswith(b"HTTP/1.1 200")


@pytest.fixture(scope="module")
def server(tiny_llava_dir, tmp_path_factory):
    server = Server(tiny_llava_dir, "--max-connections", str(BOUND), "--keepalive-timeout", str(IDLE_S),
                    "--request-read-timeout", "300", "--no-warmup", log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _chat(server) -> bytes:
    return orjson.dumps({"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_the_bound_reached_by_bodies_that_never_finish(server):
    pid = server.process.pid
    baseline = _descriptors(pid)
    body = _chat(server)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 1000}\r\n\r\n").encode()
    stuck = []
    try:
        for _ in range(BOUND):
            sock = _connect(server.port)
            sock.sendall(head + body)  # 1000 bytes short: held until the read deadline (300 s)
            stuck.append(sock)
        # Accepted in order: by the time this one is, all of them are counted.
        with _connect(server.port) as sock:
            sock.sendall(head.replace(f"{len(body) + 1000}".encode(), str(len(body)).encode()) + body)
            reply = _read_until_closed(sock)
        assert reply.startswith(b"HTTP/1.1 503"), reply[:300]
        assert b"--max-connections" in reply and b"Retry-After: 1" in reply
        for path in ("/health", "/metrics"):
            reply = _get(server.port, path)
            assert reply.startswith(b"HTTP/1.1 200"), (path, reply[:300])
        metrics = _get(server.port, "/metrics").decode()
        assert "vlmd_num_requests_running" in metrics
        # The held connections, counted (the monitors' own come on top), and the bound.
        assert _metric(metrics, "vlmd_open_connections") >= BOUND and _metric(metrics, "vlmd_max_connections") == BOUND
        assert _descriptors(pid) > BOUND  # each held connection is a descriptor
    finally:
        for sock in stuck:
            sock.close()
    # Once they are gone, a request is served (a few may still meet the bound while the
    # server reads their closes).
    statuses = []
    for _ in range(200):
        status, _ = server.request("POST", "/v1/chat/completions", body)
        statuses.append(status)
        if status == 200:
            break
        time.sleep(0.05)
    assert statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses
    assert _wait_for(lambda: _descriptors(pid) <= baseline), (_descriptors(pid), baseline)


def test_one_hundred_keep_alive_connections_are_closed_when_idle(server):
    pid = server.process.pid
    baseline = _descriptors(pid)
    sockets = [_connect(server.port) for _ in range(BOUND)]
    try:
        for sock in sockets:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        for sock in sockets:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert _descriptors(pid) > BOUND  # all of them held open after their request
        for sock in sockets:  # each closed by the server after --keepalive-timeout (the 60 s socket timeout fails it)
            assert _read_until_closed(sock) == b""
    finally:
        for sock in sockets:
            sock.close()
    assert _wait_for(lambda: _descriptors(pid) <= baseline), (_descriptors(pid), baseline)
