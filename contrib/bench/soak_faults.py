"""A longer fault-and-load soak on loopback; prints one JSON line.

Starts ``vlmd serve`` on a tiny LLaVA built into a temporary directory, with the test-only
fault injection on (an encoder that raises on a solid-grey image, a forward that raises on
``<pad>``), chunked prefill and preemption active, then runs ``vlmd.testing.soak`` from
``--clients`` threads until ``--requests`` or ``--seconds``: good requests (checked token
for token against their solo answers), abandoned streams, bad media, wrong JSON shapes,
oversize bodies, over-long text and the poisoned requests. Exit status 1 if any outcome
was not the expected one, the engine did not drain, or RSS grew by more than 1 GiB.

    python contrib/bench/soak_faults.py --requests 5000 --seconds 120 --clients 12
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

from vlmd.testing.faults import ENV
from vlmd.testing.soak import POISON_PIXEL, run_soak
from vlmd.tiny import build_tiny


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=12)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vlmd-soak-"))
    model_dir = build_tiny("llava", work / "tiny-llava", seed=0, size="tiny")
    port = free_port()
    max_request_bytes = 8 * 2**20
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           ENV: json.dumps({"encoder_pixel_value": POISON_PIXEL, "forward_token_id": 4095})}
    # The test-only launcher installs the fault-injection hook; vlmd never does.
    command = [sys.executable, "-m", "vlmd.testing.run_with_faults", "vlmd", "serve", str(model_dir),
               "--port", str(port), "--served-model-name", "tiny", "--max-model-len", "1024",
               "--max-num-batched-tokens", "256", "--num-kv-blocks", "64",
               "--mm-processor-cache-gb", "0.05", "--max-request-bytes", str(max_request_bytes)]
    log = open(work / "server.log", "wb")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the server did not start; see {work / 'server.log'}")
                time.sleep(0.2)
        result = run_soak(url, server.pid, "tiny", max_requests=args.requests, max_seconds=args.seconds,
                          clients=args.clients, max_request_bytes=max_request_bytes)
    finally:
        server.terminate()
        server.wait(15)
        log.close()
    tail = (work / "server.log").read_text(errors="replace")
    summary = result.summary()
    summary["disconnect_tracebacks"] = tail.count("Error handling request") + tail.count("ConnectionResetError")
    summary["requests_per_s"] = round(result.requests / result.seconds, 1) if result.seconds else 0.0
    print(json.dumps(summary))
    ok = (not result.unexpected and result.drained and result.rss_after - result.rss_idle < 2**30
          and summary["disconnect_tracebacks"] == 0)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
