"""A short soak over the whole API (issue 36 item 4): a tiny Qwen2-VL (images, video; a KV
cache the soak's own requests overflow, so requests are preempted and recomputed) and a tiny
Qwen2-Audio served at once, each sent every kind of vlmd.testing.soak_api's mix twice from
three clients: chat with every modality, completions, responses, structured outputs,
n > 1, penalties, streams read whole or dropped, the hostile cases of issue 36 and a body
that stops arriving. Every good answer equals the same server's answer alone; nothing is a
5xx; the engines drain; RSS stays bounded and descriptors return to where they were.
``contrib/bench/soak_api.py`` runs the same for minutes."""

from __future__ import annotations

import json
import threading

import pytest

from conftest import Server
from vlmd.testing.soak_api import (AUDIO_FLAGS, COMMON_FLAGS, MAX_REQUEST_BYTES, VISION_FLAGS, audio_mix,
                                   run_api_soak, vision_mix)

ROUNDS = 2  # each scenario this many times per server


@pytest.fixture(scope="module")
def servers(tiny_qwen2_vl_dir, tiny_qwen2_audio_dir, tmp_path_factory):
    """Both servers, started side by side (their loads overlap)."""
    logs = tmp_path_factory.mktemp("logs")
    specs = {"tiny-vl": (tiny_qwen2_vl_dir, VISION_FLAGS, vision_mix),
             "tiny-audio": (tiny_qwen2_audio_dir, AUDIO_FLAGS, audio_mix)}
    started: dict = {}
    errors: list = []

    def start(name: str) -> None:
        model_dir, flags, _ = specs[name]
        try:
            started[name] = Server(model_dir, *COMMON_FLAGS, *flags, "--no-warmup", name=name, kv_cache_gb=None,
                                   log_dir=logs)
        except Exception as exc:  # raised below, after both have had their chance
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(name,)) for name in specs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        if errors:
            raise errors[0]
        yield {name: (server, specs[name][2]) for name, server in started.items()}
    finally:  # both told at once: each waits for its engine to stop
        for server in started.values():
            server.process.terminate()
        for server in started.values():
            try:
                server.process.wait(30)
            finally:
                server.stop()  # kills one still running, closes its log


def test_a_soak_over_the_whole_api(servers):
    log_sizes = {name: server.log_path.stat().st_size for name, (server, _) in servers.items()}
    targets = [{"name": name, "url": server.url, "pid": server.process.pid, "model": name, "mix": mix,
                "max_request_bytes": MAX_REQUEST_BYTES} for name, (server, mix) in servers.items()]
    rounds = {name: ROUNDS * len(mix(name, MAX_REQUEST_BYTES)) for name, (_, mix) in servers.items()}
    # A request count ends it (max_seconds is only a cap), so every kind is sent on any host.
    results = run_api_soak(targets, max_requests=max(rounds.values()), max_seconds=600, clients=3)
    for name, result in results.items():
        summary = result.summary()
        print(name, json.dumps(summary))
        assert result.requests >= rounds[name], summary
        assert result.unexpected == [], summary
        assert summary["num_5xx"] == 0, summary
        assert result.drained, summary
        assert result.exact > 0 and all(answer is not None for answer in result.expected.values()), summary
        assert result.rss_after - result.rss_idle < 2**30, summary
        assert result.fds_after <= result.fds_warm, summary
        server = servers[name][0]
        with open(server.log_path, "rb") as log:
            log.seek(log_sizes[name])
            tail = log.read().decode(errors="replace")
        assert "Traceback" not in tail and "Error handling request" not in tail, tail[-3000:]
    assert results["tiny-vl"].preemptions > 0, results["tiny-vl"].summary()
