"""A soak over the whole API on loopback (issue 36 item 4); prints one JSON line.

Builds a tiny Qwen2-VL (images, video) and a tiny Qwen2-Audio into a temporary directory,
serves each (the vision server with a KV cache small enough that requests are preempted,
both with a short read deadline so a body that stops arriving is answered in the soak),
and runs ``vlmd.testing.soak_api`` against both at once from ``--clients`` threads each,
until ``--requests`` per server or ``--seconds``: chat with images, video and audio, text
completions, responses, structured outputs, n = 3, penalties, streams read to the end or
dropped, the hostile cases of issue 36, stalled bodies and uploads that declare 1 GB and send
nothing (issue 50: each a 413 at once, no 503 for the rest), with a hostile encoder server
behind the vision server (``vlmd.testing.hostile_encoder``: wrong shapes, NaN, silences,
drips; the vision server encodes locally and its answers stay exact). Exit status 1 if any outcome was
not the expected one (a wrong answer, a 5xx), an engine did not drain, RSS grew by more
than 1 GiB, or a server holds more descriptors after than before.

    python contrib/bench/soak_api.py --seconds 180 --clients 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vlmd.testing.hostile_encoder import HostileEncoder
from vlmd.testing.soak_api import (AUDIO_FLAGS, COMMON_FLAGS, HOSTILE_ENCODER_MODES, MAX_REQUEST_BYTES, VISION_FLAGS,
                                   audio_mix, hostile_encoder_flags, run_api_soak, vision_mix)
from vlmd.tiny import build_tiny


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(model_dir: Path, name: str, flags: tuple, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "vlmd", "serve", str(model_dir), "--port", str(port), "--served-model-name",
               name, *COMMON_FLAGS, *flags]
    log = open(log_path, "wb")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return server, f"http://127.0.0.1:{port}"


def wait_healthy(server: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server did not start; see {log_path}")
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000, help="per server")
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--clients", type=int, default=4, help="per server")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vlmd-soak-api-"))
    servers = {}
    hostile = HostileEncoder("tiny-vl", cycle=HOSTILE_ENCODER_MODES)
    try:
        for name, family, flags, mix in (("tiny-vl", "qwen2_vl", (*VISION_FLAGS, *hostile_encoder_flags(hostile.url)),
                                          vision_mix),
                                         ("tiny-audio", "qwen2_audio", AUDIO_FLAGS, audio_mix)):
            model_dir = build_tiny(family, work / name, seed=0, size="tiny")
            process, url = start(model_dir, name, flags, work / f"{name}.log")
            servers[name] = (process, url, mix)
        for name, (process, url, _) in servers.items():
            wait_healthy(process, url, work / f"{name}.log")
        targets = [{"name": name, "url": url, "pid": process.pid, "model": name, "mix": mix,
                    "max_request_bytes": MAX_REQUEST_BYTES} for name, (process, url, mix) in servers.items()]
        results = run_api_soak(targets, max_requests=args.requests, max_seconds=args.seconds, clients=args.clients)
    finally:
        for process, _, _ in servers.values():
            process.terminate()
            process.wait(15)
        hostile.close()
    summary = {"seconds": args.seconds, "clients_per_server": args.clients,
               "hostile_encoder_answers": dict(hostile.answered)}
    ok = True
    for name, result in results.items():
        figures = result.summary()
        log = (work / f"{name}.log").read_text(errors="replace")
        figures["tracebacks"] = log.count("Traceback")
        summary[name] = figures
        ok = ok and (not result.unexpected and result.drained and result.rss_after - result.rss_idle < 2**30
                     and result.fds_after <= result.fds_warm and figures["tracebacks"] == 0)
    summary["ok"] = ok
    print(json.dumps(summary))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
