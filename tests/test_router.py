"""Data parallelism behind vllm-router: two real vlmd replicas and the real router binary on
127.0.0.1 (docs/deploy.md). The router is an optional test dependency
(``vllm-router==0.1.17``); without it the module is skipped, saying so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

from conftest import Server, free_port, image_message, random_image

# The console script is installed beside the interpreter (a venv's bin/), which need not be
# on PATH when pytest runs as .venv/bin/python -m pytest.
ROUTER = shutil.which("vllm-router", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                          os.environ.get("PATH", "")]))
pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed "
                                "(pip install 'vllm-router==0.1.17'): the DP tests run the real router")

REPLICA_FLAGS = ("--no-warmup", "--torch-threads", "1", "--preprocess-threads", "1")


class Router:
    """``vllm-router`` in front of ``urls``, with the flags docs/deploy.md recommends."""

    def __init__(self, urls: list[str], log_dir: Path, policy: str = "cache_aware"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"vllm-router-{self.port}.log"
        self._log = open(self.log_path, "wb")
        command = [
            ROUTER, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *urls,
            "--policy", policy,
            # Its own metrics listener defaults to port 29000: a free one, so that tests
            # (and other routers on the host) do not collide.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--health-check-endpoint", "/health", "--health-check-interval-secs", "1",
            # One refused connection opens a worker's circuit, so the retry picks the other
            # worker instead of the dead one the policy chose.
            "--cb-failure-threshold", "1", "--retry-max-retries", "3", "--retry-initial-backoff-ms", "50",
            "--worker-startup-timeout-secs", "60", "--log-level", "warning",
        ]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm-router exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"vllm-router did not become ready:\n{self.log_path.read_text()[-4000:]}")

    def chat(self, body: dict, timeout: float = 60.0) -> tuple[int, dict | str]:
        request = urllib.request.Request(self.url + "/v1/chat/completions",
                                         data=orjson.dumps({"model": "tiny", **body}),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, orjson.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()


@pytest.fixture(scope="module")
def fleet(tiny_llava_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router-logs")
    # Both replicas load at once: start-up dominates this module's time.
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(Server, tiny_llava_dir, *REPLICA_FLAGS, log_dir=log_dir) for _ in range(2)]
        replicas = [future.result() for future in futures]
    router = None
    try:
        router = Router([r.url for r in replicas], log_dir)
        yield router, replicas
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()


def body_for(seed: int, text: str = "Describe the image.") -> dict:
    # A small image: 576 image tokens either way (LLaVA resizes), less to send and decode.
    return {"messages": image_message(text, random_image(seed, 96, 72)), "max_tokens": 8, "temperature": 0}


def prompt_tokens(replica: Server) -> float:
    return replica.metrics()["vlmd_prompt_tokens_total"]


def test_models_health_and_load_through_the_router(fleet):
    router, replicas = fleet
    with urllib.request.urlopen(router.url + "/v1/models", timeout=10) as response:
        assert [m["id"] for m in orjson.loads(response.read())["data"]] == ["tiny"]
    # What the router's load-aware policies read from each worker.
    status, raw = replicas[0].request("GET", "/get_load")
    assert status == 200 and orjson.loads(raw) == {"load": 0}
    # The router parsed it (a worker whose load it cannot read shows -1 there).
    with urllib.request.urlopen(router.url + "/get_loads", timeout=10) as response:
        loads = {w["worker"]: w["load"] for w in orjson.loads(response.read())["workers"]}
    assert loads == {r.url: 0 for r in replicas}


def test_answers_equal_a_single_servers_and_streaming_passes_through(fleet):
    router, replicas = fleet
    for seed in (11, 12):
        status, routed = router.chat(body_for(seed))
        assert status == 200, routed
        status, single = replicas[0].chat(body_for(seed))
        assert status == 200, single
        assert routed["choices"][0]["message"]["content"] == single["choices"][0]["message"]["content"]
        assert routed["usage"]["completion_tokens"] == single["usage"]["completion_tokens"] == 8
    request = urllib.request.Request(router.url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                     data=orjson.dumps({"model": "tiny", **body_for(11), "stream": True}))
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(orjson.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]
                   if orjson.loads(e)["choices"])
    assert text == single_text(replicas[0], 11)


def single_text(replica: Server, seed: int) -> str:
    status, single = replica.chat(body_for(seed))
    assert status == 200, single
    return single["choices"][0]["message"]["content"]


def test_second_question_about_an_image_reaches_the_replica_that_holds_it(fleet):
    router, replicas = fleet
    before = [prompt_tokens(r) for r in replicas]
    status, first = router.chat(body_for(21, "What is in the picture?"))
    assert status == 200, first
    grown = [prompt_tokens(r) - b for r, b in zip(replicas, before)]
    holder = max(range(2), key=lambda i: grown[i])
    assert grown[holder] > 0 and grown[1 - holder] == 0
    hits_before = replicas[holder].metrics()["vlmd_prefix_cache_hits_total"]
    status, second = router.chat(body_for(21, "What is in the picture? Answer in one word."))
    assert status == 200, second
    # The image's tokens (576) come from the holder's prefix cache.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert replicas[holder].metrics()["vlmd_prefix_cache_hits_total"] > hits_before


def test_a_killed_replica_loses_no_retryable_request_and_traffic_moves(fleet):
    router, replicas = fleet
    status, first = router.chat(body_for(31))
    assert status == 200, first
    # The replica the cache-aware policy picks for image 31 again is the one to kill.
    before = [prompt_tokens(r) for r in replicas]
    status, again = router.chat(body_for(31))
    assert status == 200, again
    grown = [prompt_tokens(r) - b for r, b in zip(replicas, before)]
    holder = max(range(2), key=lambda i: grown[i])
    survivor = replicas[1 - holder]
    # Traffic keeps flowing while the replica dies: another client asks in a loop, and each
    # of its requests records when it started and how it ended.
    results: list[tuple[float, int]] = []
    done = threading.Event()

    def client():
        for index in range(40):  # bounded: at most 40 requests of 8 tokens, until the checks end
            if done.is_set():
                return
            started = time.monotonic()
            try:
                status, _ = router.chat(body_for(40 + index))
            except OSError as error:  # the one in flight on the killed replica may be cut off
                status = f"{type(error).__name__}: {error}"
            results.append((started, status))

    background = threading.Thread(target=client)
    background.start()
    deadline = time.monotonic() + 30
    while not results and time.monotonic() < deadline:  # the client is under way
        time.sleep(0.05)
    killed_at = time.monotonic()
    replicas[holder].process.kill()  # SIGKILL: no graceful drain, connections refused
    replicas[holder].process.wait(10)
    survivor_before = prompt_tokens(survivor)
    answers = [router.chat(body_for(31)) for _ in range(4)]
    # The client's request in flight at the kill may end late (or not at all, cut off at its
    # timeout): wait, bounded, until one it started after the kill has ended too.
    deadline = time.monotonic() + 180  # past the 60 s timeout of the request in flight at the kill, and one after
    while (not any(started > killed_at for started, _ in results) and background.is_alive()
           and time.monotonic() < deadline):
        time.sleep(0.1)
    done.set()
    background.join(60)
    assert [status for status, _ in answers] == [200] * 4, answers
    assert all(a["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
               for _, a in answers)
    # All four ran on the survivor (and the other client's, at most as many tokens again each).
    assert prompt_tokens(survivor) - survivor_before >= 4 * first["usage"]["prompt_tokens"]
    # Every request sent after the kill was answered: the router retried those it sent to
    # the dead replica. Only one in flight on it at the moment of the kill may be lost.
    after = [status for started, status in results if started > killed_at]
    assert after and all(status == 200 for status in after), results
