"""Data parallelism on one host: N ``vlmd serve`` replicas, the host's cores split between
them, and vllm-router in front (docs/deploy.md).

    python contrib/deploy/dp.py --replicas 2 -- /models/llava-1.5-7b --max-model-len 4096

Everything after ``--`` goes to each ``vlmd serve`` (the model directory and its flags; none:
the built-in tiny model). Replica i listens on ``--base-port`` + i on 127.0.0.1 and is pinned
to its share of the cores this process may use, with ``--torch-threads`` set to that share
(one OpenMP team per replica, none crossing another's cores: D10). The script waits for every
replica's /health, starts the router on ``--port``, waits for the router's /health, prints its
URL, and stays in the foreground. SIGINT or SIGTERM stops the router, then the replicas
(SIGTERM, then SIGKILL after ``--stop-timeout``); so does the router exiting. A replica that
dies is reported and left to the router, which routes around it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def split_cores(cores: list[int], replicas: int) -> list[list[int]]:
    """Contiguous, near-equal shares: neighbouring core numbers usually share a cache, and a
    replica's team should not straddle more of the cache hierarchy than it must."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    if len(cores) < replicas:
        raise ValueError(f"{replicas} replicas need at least {replicas} cores; this process may use "
                         f"{len(cores)} ({cores})")
    base, extra = divmod(len(cores), replicas)
    shares, start = [], 0
    for index in range(replicas):
        size = base + (1 if index < extra else 0)
        shares.append(cores[start:start + size])
        start += size
    return shares


def wait_healthy(url: str, process: subprocess.Popen, timeout: float, what: str, stopped) -> bool:
    """True once ``url``/health answers 200; False if ``stopped()`` turns true first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stopped():
            return False
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return True
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.5)
    raise RuntimeError(f"{what} was not healthy at {url}/health after {timeout:.0f} s")


def stop_all(processes: list[tuple[str, subprocess.Popen]], timeout: float) -> None:
    for _, process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout
    for name, process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"dp: {name} did not stop in {timeout:.0f} s; killing it", file=sys.stderr)
            process.kill()
            process.wait()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, serve_args = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="vlmd replicas to start (default: 2)")
    parser.add_argument("--cores", default=None,
                        help="cores to split, e.g. 0-7 or 0,2,4,6 (default: all this process may use)")
    parser.add_argument("--base-port", type=int, default=8001, help="replica i listens on BASE_PORT + i")
    parser.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    parser.add_argument("--port", type=int, default=8000, help="port the router listens on")
    parser.add_argument("--policy", default="cache_aware",
                        choices=["cache_aware", "power_of_two", "consistent_hash", "round_robin", "random"],
                        help="the router's policy (default: cache_aware, which sends a request to the "
                             "replica whose past requests share its longest prefix)")
    parser.add_argument("--router-metrics-port", type=int, default=29000,
                        help="port of the router's own Prometheus metrics, on 127.0.0.1 (default: 29000, "
                             "the router's default)")
    parser.add_argument("--router", default=None, help="the vllm-router executable (default: on PATH or "
                                                       "beside this Python)")
    parser.add_argument("--health-timeout", type=float, default=900.0,
                        help="seconds to wait for each replica's /health (model load)")
    parser.add_argument("--stop-timeout", type=float, default=30.0,
                        help="seconds a process has to stop after SIGTERM before SIGKILL")
    return parser.parse_args(argv), serve_args


def parse_cores(text: str) -> list[int]:
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"--cores: {part!r} is not a core number or a range like 0-7")
        cores.extend(range(int(first), int(last or first) + 1))
    return sorted(set(cores))


def find_router(explicit: str | None) -> str:
    if explicit:
        return explicit
    found = shutil.which("vllm-router", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                             os.environ.get("PATH", "")]))
    if found is None:
        raise RuntimeError("vllm-router not found: pip install 'vllm-router==0.1.17', or pass --router")
    return found


def main(argv: list[str] | None = None) -> int:
    args, serve_args = parse_args(sys.argv[1:] if argv is None else argv)
    if "--port" in serve_args or "--torch-threads" in serve_args:
        raise SystemExit("dp: --port and --torch-threads are set per replica; leave them out after --")
    allowed = sorted(os.sched_getaffinity(0))
    try:
        cores = parse_cores(args.cores) if args.cores else allowed
        if not set(cores) <= set(allowed):
            raise ValueError(f"--cores {sorted(set(cores) - set(allowed))} are not available to this process")
        shares = split_cores(cores, args.replicas)
        router = find_router(args.router)
    except (ValueError, RuntimeError) as error:
        raise SystemExit(f"dp: {error}")

    processes: list[tuple[str, subprocess.Popen]] = []
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        urls = []
        for index, share in enumerate(shares):
            port = args.base_port + index
            command = [sys.executable, "-m", "vlmd", "serve", *serve_args, "--host", "127.0.0.1",
                       "--port", str(port), "--torch-threads", str(len(share))]
            # OMP_NUM_THREADS too: libraries that start their own OpenMP team before vlmd sets
            # torch's thread count still size it to the share, not the host.
            env = {**os.environ, "OMP_NUM_THREADS": str(len(share))}
            process = subprocess.Popen(command, env=env,
                                       preexec_fn=lambda share=share: os.sched_setaffinity(0, share))
            processes.append((f"replica {index} (cores {share[0]}-{share[-1]}, port {port})", process))
            urls.append(f"http://127.0.0.1:{port}")
        # The replicas load at once; wait for each in turn.
        for (name, process), url in zip(processes, urls):
            if not wait_healthy(url, process, args.health_timeout, name, lambda: stopping):
                return 0
        router_command = [router, "--host", args.host, "--port", str(args.port), "--worker-urls", *urls,
                          "--policy", args.policy, "--health-check-endpoint", "/health",
                          "--prometheus-host", "127.0.0.1", "--prometheus-port", str(args.router_metrics_port)]
        router_process = subprocess.Popen(router_command)
        processes.insert(0, ("vllm-router", router_process))
        router_url = f"http://{args.host}:{args.port}"
        if not wait_healthy(router_url, router_process, 120.0, "vllm-router", lambda: stopping):
            return 0
        print(f"dp: {len(urls)} replicas behind {router_url} (policy {args.policy}); Ctrl-C stops all",
              flush=True)
        reported: set[int] = set()
        while not stopping:
            if router_process.poll() is not None:
                print(f"dp: vllm-router exited with code {router_process.returncode}; stopping", file=sys.stderr)
                return 1
            for index, (name, process) in enumerate(processes[1:]):
                if process.poll() is not None and index not in reported:
                    reported.add(index)
                    print(f"dp: {name} exited with code {process.returncode}; the router routes around it",
                          file=sys.stderr)
            time.sleep(0.5)
        return 0
    except RuntimeError as error:
        print(f"dp: {error}", file=sys.stderr)
        return 1
    finally:
        stop_all(processes, args.stop_timeout)


if __name__ == "__main__":
    sys.exit(main())
