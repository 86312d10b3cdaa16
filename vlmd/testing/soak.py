"""A bounded fault-and-load soak against a running server on loopback (tests and contrib).

Client threads cycle through a fixed mix: good image and text requests (greedy, checked
token for token against answers the same server gave them alone before the soak), streams
the client abandons mid-way, bad media, wrong JSON shapes, oversize bodies, over-long text,
and requests poisoned for the fault-injection hook (vlmd.testing.faults); or a mix of the
caller's (``vlmd.testing.soak_api``: every route and modality, bodies that stop arriving).
It stops at a request count or a time limit, whichever comes first, then waits for the
engine to drain and the server's descriptors to settle.

Pass/fail is the caller's: ``run_soak`` returns counts, the outcomes that were not the
expected ones, RSS and open descriptors before and after, and the preemptions it caused.
"""

from __future__ import annotations

import base64
import io
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import orjson
from PIL import Image

from vlmd.testing.soak_client import answer_texts, declare_only, disconnect, metrics, post, stall, wait_drained

POISON_PIXEL = 13  # the hook's encoder_pixel_value
POISON_TEXT = "hello <pad> there"  # <pad> is the hook's forward_token_id in the tiny LLaVA


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def png_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def random_image(seed: int, width: int, height: int) -> Image.Image:
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
    stall: bool = False  # send all but the last 1000 bytes the head promises, then wait for the answer
    declare: int = 0  # send only a head declaring this many bytes (``body`` unused), then wait for the answer
    path: str = "/v1/chat/completions"


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
    exact: int = 0  # answers checked against the solo ones, and equal
    fds_warm: int = 0  # the server's open descriptors after the solo answers
    fds_after: int = 0  # and once the soak's connections are closed
    preemptions: int = 0
    expected: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "requests": self.requests, "seconds": round(self.seconds, 1),
            "outcomes": {f"{name}:{status}": count for (name, status), count in sorted(self.outcomes.items())},
            "unexpected": self.unexpected[:10], "num_unexpected": len(self.unexpected),
            "max_latency_s": {name: round(value, 3) for name, value in sorted(self.max_latency.items())},
            "rss_idle_mb": self.rss_idle >> 20, "rss_peak_mb": self.rss_peak >> 20, "rss_after_mb": self.rss_after >> 20,
            "drained": self.drained, "drain_seconds": round(self.drain_seconds, 2), "exact_answers": self.exact,
            "num_5xx": sum(count for (_, status), count in self.outcomes.items()
                           if isinstance(status, int) and status >= 500),
            "fds_warm": self.fds_warm, "fds_after": self.fds_after, "preemptions": self.preemptions,
        }


def scenarios(model: str, max_request_bytes: int, with_faults: bool) -> list[Scenario]:
    def chat(messages, **extra) -> bytes:
        return orjson.dumps({"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **extra})

    def image_messages(image: Image.Image, text: str) -> list:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(image)}},
                                              {"type": "text", "text": text}]}]

    good = [
        Scenario("good-image-0", chat(image_messages(random_image(1, 96, 64), "Describe it.")), 200, check_answer=True),
        Scenario("good-image-1", chat(image_messages(random_image(2, 64, 96), "What is this?")), 200, check_answer=True),
        Scenario("good-text", chat([{"role": "user", "content": "Tell me about zebras."}]), 200, check_answer=True),
        Scenario("good-stream", chat([{"role": "user", "content": "A story, please."}], stream=True), 200,
                 check_answer=True, stream=True),
    ]
    hostile = [
        Scenario("disconnect", chat(image_messages(random_image(3, 80, 80), "Long story."), max_tokens=200,
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


def settled_descriptors(pid: int, at_most: int, polls: int = 500) -> int:
    """The server's open descriptors once they are ``at_most`` or fewer, or after ``polls``
    looks 20 ms apart (connections the clients closed, or keep-alive ones past the server's
    idle deadline, are closed by the server a moment later)."""
    count = open_descriptors(pid)
    for _ in range(polls):
        if count <= at_most:
            break
        time.sleep(0.02)
        count = open_descriptors(pid)
    return count


def run_soak(url: str, pid: int, model: str, *, max_requests: int, max_seconds: float, clients: int = 6,
             max_request_bytes: int = 64 * 2**20, with_faults: bool = True, timeout: float = 60.0,
             mix: list[Scenario] | None = None) -> SoakResult:
    """``mix``: the scenarios to cycle through (default: ``scenarios``, the fault mix)."""
    mix = mix if mix is not None else scenarios(model, max_request_bytes, with_faults)
    port = int(url.rsplit(":", 1)[1])
    result = SoakResult(rss_idle=rss_bytes(pid))
    # Reference answers: each good request alone, before any load.
    expected = {s.name: answer_texts(*post(url, s.body, timeout, s.path), s.stream) for s in mix if s.check_answer}
    result.fds_warm = open_descriptors(pid)
    preemptions_before = metrics(url).get("vlmd_num_preemptions_total", 0.0)
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
                    status, answer = disconnect(port, scenario.body, scenario.path), None
                elif scenario.stall:
                    status, answer = stall(port, scenario.path, scenario.body, timeout), None
                elif scenario.declare:
                    status, answer = declare_only(port, scenario.path, scenario.declare, timeout), None
                else:
                    status, raw = post(url, scenario.body, timeout, scenario.path)
                    answer = answer_texts(status, raw, scenario.stream)
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
                elif scenario.check_answer:
                    result.exact += 1
                result.rss_peak = max(result.rss_peak, rss_bytes(pid))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.seconds = time.monotonic() - started
    result.drained, result.drain_seconds = wait_drained(url, 30.0)
    result.preemptions = int(metrics(url).get("vlmd_num_preemptions_total", 0.0) - preemptions_before)
    result.fds_after = settled_descriptors(pid, result.fds_warm)
    result.rss_after = rss_bytes(pid)
    result.expected = expected
    return result
