"""A bounded fault-and-load soak against a running server on loopback (tests and contrib).

Client threads cycle through a fixed mix: good image and text requests (greedy, checked
token for token against answers the same server gave them alone before the soak), streams
the client abandons mid-way, bad media, wrong JSON shapes, oversize bodies, over-long text,
and requests poisoned for the fault-injection hook (vlmd.testing.faults). It stops at a
request count or a time limit, whichever comes first, then waits for the engine to drain.

Pass/fail is the caller's: ``run_soak`` returns counts, the outcomes that were not the
expected ones, and RSS before and after.
"""

from __future__ import annotations

import base64
import io
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import orjson
from PIL import Image

POISON_PIXEL = 13  # the hook's encoder_pixel_value
POISON_TEXT = "hello <pad> there"  # <pad> is the hook's forward_token_id in the tiny LLaVA


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _png_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


@dataclass
class Scenario:
    name: str
    body: bytes
    expect: int  # HTTP status
    check_answer: bool = False
    stream: bool = False
    disconnect: bool = False


@dataclass
class SoakResult:
    requests: int = 0
    seconds: float = 0.0
    outcomes: Counter = field(default_factory=Counter)  # (scenario, status) -> count
    unexpected: list = field(default_factory=list)
    max_latency: dict = field(default_factory=dict)
    rss_idle: int = 0
    rss_peak: int = 0
    rss_after: int = 0
    drained: bool = False
    drain_seconds: float = 0.0

    def summary(self) -> dict:
        return {
            "requests": self.requests, "seconds": round(self.seconds, 1),
            "outcomes": {f"{name}:{status}": count for (name, status), count in sorted(self.outcomes.items())},
            "unexpected": self.unexpected[:10], "num_unexpected": len(self.unexpected),
            "max_latency_s": {name: round(value, 3) for name, value in sorted(self.max_latency.items())},
            "rss_idle_mb": self.rss_idle >> 20, "rss_peak_mb": self.rss_peak >> 20, "rss_after_mb": self.rss_after >> 20,
            "drained": self.drained, "drain_seconds": round(self.drain_seconds, 2),
        }


def scenarios(model: str, max_request_bytes: int, with_faults: bool) -> list[Scenario]:
    def chat(messages, **extra) -> bytes:
        return orjson.dumps({"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **extra})

    def image_messages(image: Image.Image, text: str) -> list:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url(image)}},
                                              {"type": "text", "text": text}]}]

    good = [
        Scenario("good-image-0", chat(image_messages(_image(1, 96, 64), "Describe it.")), 200, check_answer=True),
        Scenario("good-image-1", chat(image_messages(_image(2, 64, 96), "What is this?")), 200, check_answer=True),
        Scenario("good-text", chat([{"role": "user", "content": "Tell me about zebras."}]), 200, check_answer=True),
        Scenario("good-stream", chat([{"role": "user", "content": "A story, please."}], stream=True), 200,
                 check_answer=True, stream=True),
    ]
    hostile = [
        Scenario("disconnect", chat(image_messages(_image(3, 80, 80), "Long story."), max_tokens=200,
                                    ignore_eos=True, stream=True), 200, stream=True, disconnect=True),
        Scenario("bad-base64", chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!not-base64"}}]}]), 400),
        Scenario("not-an-image", chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"GIF89a" * 50).decode()}}]}]), 400),
        Scenario("json-shape", orjson.dumps({"model": model, "messages": {"role": "user"}}), 400),
        Scenario("json-broken", b'{"model": "x", "messages": [', 400),
        Scenario("long-text", chat([{"role": "user", "content": "a" * 2_000_000}]), 400),
        Scenario("oversize-body", b'{"pad": "' + b"a" * (max_request_bytes + 1024) + b'"}', 413),
    ]
    poisoned = [
        Scenario("poison-encoder", chat(image_messages(Image.new("RGB", (64, 64), (POISON_PIXEL,) * 3), "Describe.")), 500),
        Scenario("poison-forward", chat([{"role": "user", "content": POISON_TEXT}]), 500),
    ] if with_faults else []
    # Good requests dominate, as in real traffic; every hostile kind still comes round often.
    return good * 3 + hostile + poisoned


def _post(url: str, body: bytes, timeout: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _answer(status: int, raw: bytes, stream: bool) -> str | None:
    if status != 200:
        return None
    if not stream:
        return orjson.loads(raw)["choices"][0]["message"]["content"]
    text = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            event = orjson.loads(line[6:])
            if "error" in event:
                return None
            for choice in event.get("choices", ()):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


def _disconnect(port: int, body: bytes) -> int:
    """Send a streaming request, read until the first event, then reset the connection."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    data = b""
    while b"data: " not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    return status


def _metrics(url: str) -> dict[str, float]:
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
        m = _metrics(url)
        if (m["vlmd_num_requests_running"] == 0 and m["vlmd_num_requests_waiting"] == 0
                and m["vlmd_kv_cache_free_blocks"] == m["vlmd_kv_cache_total_blocks"]
                and m.get("vlmd_inflight_media_bytes", 0) == 0 and m.get("vlmd_preprocess_in_flight", 0) == 0):
            return True, time.monotonic() - started
        time.sleep(0.05)
    return False, time.monotonic() - started


def run_soak(url: str, pid: int, model: str, *, max_requests: int, max_seconds: float, clients: int = 6,
             max_request_bytes: int = 64 * 2**20, with_faults: bool = True, timeout: float = 60.0) -> SoakResult:
    mix = scenarios(model, max_request_bytes, with_faults)
    port = int(url.rsplit(":", 1)[1])
    result = SoakResult(rss_idle=rss_bytes(pid))
    # Reference answers: each good request alone, before any load.
    expected = {s.name: _answer(*_post(url, s.body, timeout), s.stream) for s in mix if s.check_answer}
    lock = threading.Lock()
    counter = iter(range(max_requests))
    deadline = time.monotonic() + max_seconds
    started = time.monotonic()

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            scenario = mix[index % len(mix)]  # every kind in turn, whichever client sends it
            began = time.monotonic()
            try:
                if scenario.disconnect:
                    status, answer = _disconnect(port, scenario.body), None
                else:
                    status, raw = _post(url, scenario.body, timeout)
                    answer = _answer(status, raw, scenario.stream)
            except Exception as exc:  # a connection error is an outcome too
                status, answer = f"error:{type(exc).__name__}", None
            seconds = time.monotonic() - began
            with lock:
                result.requests += 1
                result.outcomes[(scenario.name, status)] += 1
                result.max_latency[scenario.name] = max(result.max_latency.get(scenario.name, 0.0), seconds)
                if status != scenario.expect:
                    result.unexpected.append(f"{scenario.name}: status {status}, expected {scenario.expect}")
                elif scenario.check_answer and answer != expected[scenario.name]:
                    result.unexpected.append(f"{scenario.name}: {answer!r} != {expected[scenario.name]!r}")
                result.rss_peak = max(result.rss_peak, rss_bytes(pid))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.seconds = time.monotonic() - started
    result.drained, result.drain_seconds = wait_drained(url, 30.0)
    result.rss_after = rss_bytes(pid)
    result.expected = expected
    return result
