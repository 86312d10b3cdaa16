"""vLLM-CPU and vlmd on the same checkpoint, one after the other in one run, as one JSON line.

The same request stream against each server (client code from bench_chat.py): 640x480
JPEGs, ``--output-tokens`` with ignore_eos, streaming, four workloads (c1 / c8 x every image
new / one repeated image), image seeds fresh per run and disjoint between workloads. For
each server: req/s, TTFT p50 and time per output token (inter-token p50) per workload,
start-up seconds (spawn to a 200 from /health) and RSS (summed over its process group,
after the load). Ratios are vlmd / vLLM for req/s and vLLM / vlmd for times, so > 1 means
vlmd is better. A human table goes to stderr.

vLLM runs from ``--vllm-venv`` (recipe: /work/shared/peer/README.md); it is skipped, not
faked, when that venv is missing. Each server is stopped by its process group.

    python contrib/bench/side_by_side.py --size small --num-requests 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chat import make_jpeg, run_level  # noqa: E402

WORKLOADS = (("c1_new", 1, False), ("c1_repeated", 1, True), ("c8_new", 8, False), ("c8_repeated", 8, True))


def vllm_command(venv: Path, model_dir: str, port: int, dtype: str, work: Path) -> tuple[list[str], dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
           "TMPDIR": str(work / "tmp"), "VLLM_RPC_BASE_PATH": str(work / "tmp"), "VLLM_CACHE_ROOT": str(work / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / "cache" / "inductor"), "XDG_CACHE_HOME": str(work / "cache")}
    command = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench", "--dtype", dtype,
               "--max-model-len", "2048", "--limit-mm-per-prompt", '{"image": 1}']
    return command, env


def vlmd_command(model_dir: str, port: int, dtype: str, flags: list[str]) -> tuple[list[str], dict]:
    command = [sys.executable, "-m", "vlmd", "serve", model_dir, "--port", str(port),
               "--served-model-name", "bench", "--dtype", dtype, *flags]
    return command, {**os.environ, "HF_HUB_OFFLINE": "1"}


def start(name: str, command: list[str], env: dict, port: int, timeout_s: float) -> tuple[subprocess.Popen, float]:
    log = open(Path(tempfile.gettempdir()) / f"side-by-side-{name}-{port}.log", "wb")
    started = time.monotonic()
    # Its own session: the whole group (vLLM's engine-core child included) is stopped together.
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}; see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return process, time.monotonic() - started
        except OSError:
            time.sleep(0.5)
    stop(process)
    raise RuntimeError(f"{name} did not start within {timeout_s} s; see {log.name}")


def stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def group_rss_gib(pgid: int) -> float:
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return round(total / 2**30, 3)


def measure(name, command, env, port, args, seed) -> dict:
    process, startup = start(name, command, env, port, args.startup_timeout)
    url = f"http://127.0.0.1:{port}"
    try:
        warm = make_jpeg(seed - 1, args.width, args.height)
        asyncio.run(run_level(url, "bench", 1, 1, 4, [warm]))
        result = {"startup_s": round(startup, 1), "workloads": {}}
        for index, (workload, concurrency, repeated) in enumerate(WORKLOADS):
            base = seed + 1000 * (index + 1)
            count = 1 if repeated else args.num_requests
            images = [make_jpeg(base + i, args.width, args.height) for i in range(count)]
            level = asyncio.run(run_level(url, "bench", concurrency, args.num_requests, args.output_tokens, images))
            result["workloads"][workload] = {key: level[key] for key in ("req_per_s", "ttft_p50_s", "itl_p50_s", "wall_s")}
        result["rss_gib"] = group_rss_gib(process.pid)
        return result
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--model-dir")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000, help="image seed base (fresh per run)")
    parser.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("W", "/work/peer")) / "vllm-venv")
    parser.add_argument("--vllm-work", type=Path, default=Path(os.environ.get("W", "/work/peer")))
    parser.add_argument("--vlmd-flag", action="append", default=[], help="extra flag for vlmd serve (repeatable)")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--port", type=int, default=8313)
    args = parser.parse_args()

    model_dir = args.model_dir
    if model_dir is None:
        from vlmd.testing.tiny import build_tiny

        target = Path(os.environ.get("VLMD_CACHE_DIR", Path.home() / ".cache" / "vlmd")) / "bench" / f"llava-{args.size}-seed0"
        if not (target / "config.json").exists():
            build_tiny("llava", target, seed=0, size=args.size)
        model_dir = str(target)

    results: dict = {}
    if (args.vllm_venv / "bin" / "python").exists():
        for sub in ("tmp", "cache"):
            (args.vllm_work / sub).mkdir(parents=True, exist_ok=True)
        command, env = vllm_command(args.vllm_venv, model_dir, args.port, args.dtype, args.vllm_work)
        results["vllm"] = measure("vllm", command, env, args.port, args, args.seed)
    else:
        print(f"no vLLM venv at {args.vllm_venv}: measuring vlmd only", file=sys.stderr)
    command, env = vlmd_command(model_dir, args.port + 1, args.dtype, args.vlmd_flag)
    results["vlmd"] = measure("vlmd", command, env, args.port + 1, args, args.seed)

    ratios = {}
    if "vllm" in results:
        peer, ours = results["vllm"], results["vlmd"]
        for workload, _, _ in WORKLOADS:
            a, b = peer["workloads"][workload], ours["workloads"][workload]
            ratios[workload] = {
                "req_per_s": round(b["req_per_s"] / a["req_per_s"], 3),
                "ttft_p50": round(a["ttft_p50_s"] / b["ttft_p50_s"], 3),
                "tpot": round(a["itl_p50_s"] / b["itl_p50_s"], 3) if a["itl_p50_s"] and b["itl_p50_s"] else None,
            }
        ratios["startup"] = round(peer["startup_s"] / ours["startup_s"], 2)
        ratios["rss"] = round(peer["rss_gib"] / ours["rss_gib"], 2)
    print(json.dumps({"model": model_dir, "dtype": args.dtype, "num_requests": args.num_requests,
                      "output_tokens": args.output_tokens, "seed": args.seed, "servers": results,
                      "vlmd_advantage": ratios}))
    for workload, _, _ in WORKLOADS:
        row = [f"{workload:12s}"]
        for server in ("vllm", "vlmd"):
            if server in results:
                w = results[server]["workloads"][workload]
                row.append(f"{server} {w['req_per_s']:.3f} req/s ttft {w['ttft_p50_s']:.3f} tpot {w['itl_p50_s']}")
        if workload in ratios:
            row.append(f"vlmd/vllm req/s {ratios[workload]['req_per_s']:.2f}")
        print(" | ".join(row), file=sys.stderr)


if __name__ == "__main__":
    main()
