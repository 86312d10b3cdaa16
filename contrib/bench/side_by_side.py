"""vLLM-CPU, llama.cpp and vlmd on the same checkpoint, in one run, as one JSON line.

The same request stream against each server (client code from bench_chat.py): 640x480
JPEGs, ``--output-tokens`` with ignore_eos, streaming, four workloads (c1 / c8 x every image
new / one repeated image), image seeds fresh per run and disjoint between workloads. For
each server: req/s, TTFT p50 and time per output token (inter-token p50) per workload,
start-up seconds (spawn to a 200 from /health) and RSS (summed over its process group,
after the load). Ratios are vlmd / vLLM for req/s and vLLM / vlmd for times, so > 1 means
vlmd is better. A human table goes to stderr.

vLLM runs from ``--vllm-venv`` (recipe: /work/shared/peer/README.md); it is skipped, not
faked, when that venv is missing (or with ``--no-vllm``). llama.cpp runs when ``--llama-cpp``
names its built tree (``llama_cpp_peer.py``: conversion to GGUF, ``llama-server``). Each
server is stopped by its process group. ``--family`` measures another family's checkpoint
instead of LLaVA-1.5 (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, InternVL, Gemma 3, Gemma 4;
llama.cpp's converter takes Qwen2-VL, LLaVA-1.5 only through its legacy scripts; Llama 3.2
Vision, which vLLM no longer serves, is compared with transformers in
``bench_vs_transformers.py``). Each server's ``prompt_tokens`` for the same image request is
reported: the same processor should give the same count. (Gemma 4: vLLM resizes images with
transformers' torchvision image processor, vlmd as its PIL one does; a 640x480 image becomes
912x672 a few levels apart, so greedy text may part after a few tokens, as in transformers
with one processor or the other.)

``--interleave N``: every server up at once, each workload run against each in turn (the
order reversed every round) N times, with fresh images each round that every server gets;
figures are per-workload medians, and the ratios also come per round. Why: this host's
speed drifts by tens of percent within minutes, and one after the other puts minutes
between the two servers' runs of a workload; interleaved, seconds. While one server runs
a workload the other's process group is stopped (SIGSTOP, then SIGCONT for its turn): an
idle vLLM-CPU 0.32 server used ~30 % of a core (``idle_cpu_percent``, measured before the
rounds), which would otherwise be taken from vlmd.

    python contrib/bench/side_by_side.py --size small --num-requests 24
    python contrib/bench/side_by_side.py --size small --num-requests 24 --interleave 3
    python contrib/bench/side_by_side.py --family qwen2_vl --interleave 2 \
        --llama-cpp /path/to/llama.cpp --llama-cpp-python /path/to/converter-venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chat import make_jpeg, run_level  # noqa: E402
import llama_cpp_peer  # noqa: E402

# Families whose chat takes one image a request, as every workload here sends.
IMAGE_FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl", "gemma3", "gemma4")
WORKLOADS = (("c1_new", 1, False), ("c1_repeated", 1, True), ("c8_new", 8, False), ("c8_repeated", 8, True))


# Families whose tiny checkpoint vLLM loads only from the published layout (``published_layout``).
PUBLISHED_LAYOUT_FAMILIES = ("llava", "gemma3")


def published_layout(model_dir: str) -> str:
    """The checkpoint with its vision tower (LLaVA-1.5's CLIP, Gemma 3's SigLIP) under
    ``vision_tower.vision_model.`` (the published layout), written beside it, again whenever
    the checkpoint is newer than the copy (a rebuilt tokenizer or weights must reach both).

    The tiny builder saves transformers 5's layout (``vision_tower.embeddings...``), which
    vLLM 0.32's loader rejects; vlmd reads either. Both servers then load this same copy.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = Path(model_dir)
    target = source.parent / (source.name + "-published")
    files = sorted(source.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"expected one .safetensors file in {source}, found {len(files)}")
    newest_source = max(item.stat().st_mtime for item in source.iterdir() if item.is_file())
    if (target / "model.safetensors").exists() and (target / "model.safetensors").stat().st_mtime >= newest_source:
        return str(target)
    target.mkdir(exist_ok=True)
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            (target / item.name).write_bytes(item.read_bytes())
    tensors = {}
    with safe_open(str(files[0]), framework="pt") as handle:
        for name in handle.keys():
            renamed = name
            if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
                renamed = "vision_tower.vision_model." + name[len("vision_tower."):]
            tensors[renamed] = handle.get_tensor(name)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return str(target)


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


def group_processes(pgid: int):
    """/proc entries of the live processes in process group ``pgid``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid:
                yield entry
        except OSError:  # gone meanwhile
            continue


def group_rss_gib(pgid: int) -> float:
    total = 0
    for entry in group_processes(pgid):
        try:
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return round(total / 2**30, 3)


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in the group."""
    total = 0
    for entry in group_processes(pgid):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def prompt_tokens(url: str, image_url: str) -> int | None:
    """``usage.prompt_tokens`` of one image request (non-streamed, 1 token)."""
    body = json.dumps({"model": "bench", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "Describe this image."}]}]})
    request = urllib.request.Request(url + "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read()).get("usage", {}).get("prompt_tokens")


def run_workload(url: str, workload: tuple, images: list, args) -> dict:
    _, concurrency, _ = workload
    level = asyncio.run(run_level(url, "bench", concurrency, args.num_requests, args.output_tokens, images))
    return {key: level[key] for key in ("req_per_s", "ttft_p50_s", "itl_p50_s", "wall_s")}


def workload_images(workload: tuple, base: int, args) -> list:
    return [make_jpeg(base + i, args.width, args.height) for i in range(1 if workload[2] else args.num_requests)]


def interleaved(servers: dict, args) -> dict:
    """``servers``: name -> (command, env, port). Both up at once; see the module doc."""
    started, results = {}, {}
    try:
        for name, (command, env, port) in servers.items():
            process, startup = start(name, command, env, port, args.startup_timeout)
            started[name] = process
            results[name] = {"startup_s": round(startup, 1), "workloads": {}, "rounds": {}}
        for name, process in started.items():
            url = f"http://127.0.0.1:{servers[name][2]}"
            asyncio.run(run_level(url, "bench", 1, 1, 4, [make_jpeg(args.seed - 1, args.width, args.height)]))
            results[name]["prompt_tokens"] = prompt_tokens(url, make_jpeg(args.seed - 2, args.width, args.height))
        for name, process in started.items():  # idle: what it costs the other server
            before = group_cpu_seconds(process.pid)
            time.sleep(3)
            results[name]["idle_cpu_percent"] = round((group_cpu_seconds(process.pid) - before) / 3 * 100, 1)
        names = list(started)
        for name in names:  # each runs alone: the other is stopped (SIGSTOP) meanwhile
            os.killpg(started[name].pid, signal.SIGSTOP)
        for round_index in range(args.interleave):
            order = names if round_index % 2 == 0 else names[::-1]
            for index, workload in enumerate(WORKLOADS):
                images = workload_images(workload, args.seed + 1000 * (index + 1) + 100_000 * round_index, args)
                for name in order:
                    url = f"http://127.0.0.1:{servers[name][2]}"
                    os.killpg(started[name].pid, signal.SIGCONT)
                    try:
                        results[name]["rounds"].setdefault(workload[0], []).append(
                            run_workload(url, workload, images, args))
                    finally:
                        os.killpg(started[name].pid, signal.SIGSTOP)
        for name in names:
            os.killpg(started[name].pid, signal.SIGCONT)
        for name in names:
            for workload, runs in results[name]["rounds"].items():
                results[name]["workloads"][workload] = {
                    key: round(statistics.median(run[key] for run in runs), 4) for key in runs[0]}
            results[name]["rss_gib"] = group_rss_gib(started[name].pid)
        return results
    finally:
        for process in started.values():
            try:
                os.killpg(process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            stop(process)


def measure(name, command, env, port, args, seed) -> dict:
    process, startup = start(name, command, env, port, args.startup_timeout)
    url = f"http://127.0.0.1:{port}"
    try:
        warm = make_jpeg(seed - 1, args.width, args.height)
        asyncio.run(run_level(url, "bench", 1, 1, 4, [warm]))
        result = {"startup_s": round(startup, 1), "workloads": {},
                  "prompt_tokens": prompt_tokens(url, make_jpeg(seed - 2, args.width, args.height))}
        for index, workload in enumerate(WORKLOADS):
            images = workload_images(workload, seed + 1000 * (index + 1), args)
            result["workloads"][workload[0]] = run_workload(url, workload, images, args)
        result["rss_gib"] = group_rss_gib(process.pid)
        return result
    finally:
        stop(process)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say where the peers are and how the servers start (scaling.py too)."""
    parser.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("W", "/work/peer")) / "vllm-venv")
    parser.add_argument("--vllm-work", type=Path, default=Path(os.environ.get("W", "/work/peer")))
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's tree with build/bin/llama-server")
    parser.add_argument("--llama-cpp-python", type=Path, default=Path(sys.executable),
                        help="a python with torch, transformers and llama.cpp's gguf-py, for its converter")
    parser.add_argument("--vlmd-flag", action="append", default=[], help="extra flag for vlmd serve (repeatable)")
    parser.add_argument("--startup-timeout", type=float, default=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llava", choices=sorted(IMAGE_FAMILIES),
                        help="the tiny builder's family (llama.cpp: qwen2_vl only)")
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--model-dir")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000, help="image seed base (fresh per run)")
    add_server_arguments(parser)
    parser.add_argument("--llama-cpp-type", default="f32", choices=["f32", "q8_0"],
                        help="the GGUF weights' type (the projector stays f32)")
    parser.add_argument("--port", type=int, default=8313)
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="both servers up at once, workloads alternated between them ROUNDS times "
                             "(0: one after the other)")
    args = parser.parse_args()

    model_dir = args.model_dir
    if model_dir is None:
        from vlmd.config import cache_dir
        from vlmd.tiny import build_tiny

        target = cache_dir() / "bench" / f"{args.family}-{args.size}-seed0"
        if not (target / "config.json").exists():
            build_tiny(args.family, target, seed=0, size=args.size)
        model_dir = str(target)
    if args.family in PUBLISHED_LAYOUT_FAMILIES:
        model_dir = published_layout(model_dir)

    servers: dict = {}
    if args.llama_cpp is not None:
        gguf, mmproj = llama_cpp_peer.convert(model_dir, args.llama_cpp, args.llama_cpp_python, args.llama_cpp_type)
        servers["llama.cpp"] = (*llama_cpp_peer.command(args.llama_cpp, model_dir, gguf, mmproj, args.port + 2, 8, 2048),
                                args.port + 2)
    if args.no_vllm:
        pass
    elif (args.vllm_venv / "bin" / "python").exists():
        for sub in ("tmp", "cache"):
            (args.vllm_work / sub).mkdir(parents=True, exist_ok=True)
        servers["vllm"] = (*vllm_command(args.vllm_venv, model_dir, args.port, args.dtype, args.vllm_work), args.port)
    else:
        print(f"no vLLM venv at {args.vllm_venv}: measuring vlmd only", file=sys.stderr)
    servers["vlmd"] = (*vlmd_command(model_dir, args.port + 1, args.dtype, args.vlmd_flag), args.port + 1)
    if args.interleave > 0:
        results = interleaved(servers, args)
    else:
        results = {name: measure(name, command, env, port, args, args.seed)
                   for name, (command, env, port) in servers.items()}

    ratios = {peer: advantage(results[peer], results["vlmd"]) for peer in results if peer != "vlmd"}
    print(json.dumps({"model": model_dir, "dtype": args.dtype, "num_requests": args.num_requests,
                      "output_tokens": args.output_tokens, "seed": args.seed, "interleave": args.interleave,
                      "servers": results,
                      "vlmd_advantage": ratios}))
    for workload, _, _ in WORKLOADS:
        row = [f"{workload:12s}"]
        for server, result in results.items():
            w = result["workloads"][workload]
            row.append(f"{server} {w['req_per_s']:.3f} req/s ttft {w['ttft_p50_s']:.3f} tpot {w['itl_p50_s']}")
        for peer, by_workload in ratios.items():
            rounds = by_workload[workload].get("req_per_s_rounds")
            row.append(f"vlmd/{peer} req/s {by_workload[workload]['req_per_s']:.2f}"
                       + (f" (rounds {rounds})" if rounds else ""))
        print(" | ".join(row), file=sys.stderr)


def advantage(peer: dict, ours: dict) -> dict:
    """vlmd against one peer: req/s ours / theirs, times theirs / ours (> 1: vlmd better)."""
    ratios = {}
    for workload, _, _ in WORKLOADS:
        a, b = peer["workloads"][workload], ours["workloads"][workload]
        ratios[workload] = {
            "req_per_s": round(b["req_per_s"] / a["req_per_s"], 3),
            "ttft_p50": round(a["ttft_p50_s"] / b["ttft_p50_s"], 3),
            "tpot": round(a["itl_p50_s"] / b["itl_p50_s"], 3) if a["itl_p50_s"] and b["itl_p50_s"] else None,
        }
        if "rounds" in ours:  # interleaved: the ratio of each round too
            ratios[workload]["req_per_s_rounds"] = [
                round(b_run["req_per_s"] / a_run["req_per_s"], 3)
                for a_run, b_run in zip(peer["rounds"][workload], ours["rounds"][workload])]
    ratios["startup"] = round(peer["startup_s"] / ours["startup_s"], 2)
    ratios["rss"] = round(peer["rss_gib"] / ours["rss_gib"], 2)
    return ratios


if __name__ == "__main__":
    main()
