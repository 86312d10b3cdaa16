"""A short soak over the whole API (issue 36 item 4): a tiny Qwen2-VL (images, video; a KV
cache the soak's own requests overflow, so requests are preempted and recomputed) and a tiny
Qwen2-Audio (the session's) soaked at once, each sent every kind of vlmd.testing.soak_api's mix twice from
three clients: chat with every modality, completions, responses, structured outputs,
n > 1, penalties, streams read whole or dropped, the hostile cases of issue 36, a body
that stops arriving, uploads that declare 1 GB and send nothing, and (issue 50) a hostile
encoder server behind the vision server, every answer of which fails and is encoded
locally instead. Every good answer equals the same server's answer alone; nothing is a
5xx; the engines drain; RSS stays bounded and descriptors return to where they were.
``contrib/bench/soak_api.py`` runs the same for minutes."""

from __future__ import annotations

import json

import pytest

from conftest import Server
from vlmd.config import ServeConfig
from vlmd.testing.hostile_encoder import HostileEncoder
from vlmd.testing.soak_api import (COMMON_FLAGS, HOSTILE_ENCODER_MODES, MAX_REQUEST_BYTES, VISION_FLAGS, audio_mix,
                                   hostile_encoder_flags, run_api_soak, vision_mix)

ROUNDS = 2  # each scenario this many times per server
DEFAULT_MAX_REQUEST_BYTES = ServeConfig.max_request_bytes


@pytest.fixture(scope="module")
def servers(tiny_qwen2_vl_dir, qwen2_audio_server, tmp_path_factory):
    """A vision server of the soak's own, and the session's Qwen2-Audio server (its default
    bounds: 64 MiB bodies; the audio mix sends no stalled body, which its 30 s read deadline
    would answer only after 30 s). The vision server's one encoder server is hostile."""
    hostile = HostileEncoder("tiny-vl", cycle=HOSTILE_ENCODER_MODES)
    vision = Server(tiny_qwen2_vl_dir, *COMMON_FLAGS, *VISION_FLAGS, *hostile_encoder_flags(hostile.url),
                    "--no-warmup", name="tiny-vl", kv_cache_gb=None, log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield {"tiny-vl": (vision, vision_mix, MAX_REQUEST_BYTES),
               "tiny-audio": (qwen2_audio_server, audio_mix, DEFAULT_MAX_REQUEST_BYTES), "hostile": hostile}
    finally:
        vision.stop()
        hostile.close()


def test_a_soak_over_the_whole_api(servers):
    hostile = servers.pop("hostile")
    log_sizes = {name: server.log_path.stat().st_size for name, (server, _, _) in servers.items()}
    targets = [{"name": name, "url": server.url, "pid": server.process.pid, "model": server.model, "mix": mix,
                "max_request_bytes": max_bytes} for name, (server, mix, max_bytes) in servers.items()]
    rounds = {name: ROUNDS * len(mix(name, 1)) for name, (_, mix, _) in servers.items()}
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
    # Its encoder server was asked, failed every time, and the answers above are still exact.
    failures = servers["tiny-vl"][0].metrics()
    assert sum(hostile.answered.values()) > 0
    assert sum(value for name, value in failures.items()
               if name.startswith("vlmd_encoder_server_failures_total")) == sum(hostile.answered.values())
