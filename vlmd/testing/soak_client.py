"""The soak's client side on the wire (vlmd.testing.soak): requests sent with urllib or a
raw socket (a stream dropped after its first event, a body that stops arriving), answers
read back as each choice's text, and the server's /metrics and drain state."""

from __future__ import annotations

import socket
import struct
import time
import urllib.error
import urllib.request

import orjson


def post(url: str, body: bytes, timeout: float, path: str = "/v1/chat/completions") -> tuple[int, bytes]:
    request = urllib.request.Request(url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _choice_text(choice: dict) -> str:
    """A choice's text: a chat message's or delta's content, or a completion's text."""
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""


def answer_texts(status: int, raw: bytes, stream: bool) -> tuple | None:
    """Each choice's text (a response's output text), in choice order; None for an error."""
    if status != 200:
        return None
    if not stream:
        body = orjson.loads(raw)
        if "output" in body:  # /v1/responses
            return tuple(part["text"] for item in body["output"] for part in item.get("content", ()))
        return tuple(_choice_text(choice) for choice in sorted(body["choices"], key=lambda c: c["index"]))
    texts: dict[int, list[str]] = {}
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            event = orjson.loads(line[6:])
            if "error" in event:
                return None
            for choice in event.get("choices", ()):
                texts.setdefault(choice["index"], []).append(_choice_text(choice))
    return tuple("".join(texts[index]) for index in sorted(texts))


def _post(port: int, path: str, body: bytes, timeout: float, extra_length: int = 0) -> socket.socket:
    """A socket that has sent ``POST path`` with ``body``, its Content-Length ``extra_length``
    bytes more than the body."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + extra_length}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> int:
    """Read until ``marker`` arrives (or the server closes): the response's status, 0 if none."""
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def stall(port: int, path: str, body: bytes, timeout: float) -> int:
    """Promise 1000 bytes more than the body, send the body, and wait: the status the server
    answers at its read deadline (0 if it closes without one)."""
    with _post(port, path, body, timeout, extra_length=1000) as sock:
        return _read_until(sock, b"\r\n")


def declare_only(port: int, path: str, declared: int, timeout: float) -> int:
    """Send a head that declares ``declared`` body bytes and nothing more, and wait: the
    status the server answers (a declaration past its bound: a 413 without waiting)."""
    with _post(port, path, b"", timeout, extra_length=declared) as sock:
        return _read_until(sock, b"\r\n")


def disconnect(port: int, body: bytes, path: str = "/v1/chat/completions") -> int:
    """Send a streaming request, read until the first event, then reset the connection."""
    sock = _post(port, path, body, timeout=30)
    status = _read_until(sock, b"data: ")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    return status


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        raw = response.read().decode()
    values = {}
    for line in raw.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def wait_drained(url: str, timeout: float) -> tuple[bool, float]:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        m = metrics(url)
        if (m["vlmd_num_requests_running"] == 0 and m["vlmd_num_requests_waiting"] == 0
                and m["vlmd_kv_cache_free_blocks"] == m["vlmd_kv_cache_total_blocks"]
                and m.get("vlmd_inflight_media_bytes", 0) == 0 and m.get("vlmd_preprocess_in_flight", 0) == 0):
            return True, time.monotonic() - started
        time.sleep(0.05)
    return False, time.monotonic() - started
