"""Serving layouts on one host, in one run: which to choose for which workload (docs/deploy.md,
"Which layout").

Layouts (each started, waited for at /health, measured, stopped by its process group):

- ``single``: one ``vlmd serve`` with both cores (``--torch-threads 2``);
- ``epd``: ``vlmd serve --encoder-only`` pinned to the first core and a language server with
  ``--encoder-urls`` pinned to the second (``--torch-threads 1`` each; ``--encoder-fallback
  fail``, so a request the encoder server did not serve fails instead of being measured as a
  local encode);
- ``dp2``: ``contrib/deploy/dp.py --replicas 2`` (a core each, vllm-router in front);
- ``tp2``: ``vlmd serve --tensor-parallel-size 2`` (vlmd pins one rank to each core).

Workloads: 4 images a request (640x480 JPEGs; ``--images-per-request``) at c1 and c4 on the small LLaVA and the tiny
Qwen2-VL, ``single`` against ``epd``; single-image requests at c8 on the small LLaVA,
``single`` against ``dp2`` and ``tp2``. Every request streams ``--output-tokens`` tokens with
``ignore_eos``; images are fresh per layout, workload and round, so no cache helps. The
streaming client and the images are bench_chat.py's, start, stop and CPU accounting
side_by_side.py's.

Output: one JSON line per workload and layout (req/s, TTFT p50, time per output token p50
(per request, then the median), ``prompt_tokens``, and over the workload: from each server's
/metrics the seconds its engine spent in steps and in the encoder and its preprocessing
threads in fetch + processing, and each process group's CPU seconds), then
one summary line: each layout against ``single`` (req/s layout/single, times single/layout:
> 1 means the layout is better), the best layout per figure, the host's CPU model and its load
average before and after. A human table goes to stderr.

    python contrib/bench/bench_layouts.py
    python contrib/bench/bench_layouts.py --only llava_1img_c8 --requests-1img 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_chat import make_jpeg, stream_chat  # noqa: E402
from side_by_side import group_cpu_seconds, start, stop  # noqa: E402

DP_SCRIPT = HERE.parent / "deploy" / "dp.py"
BASELINE = "single"
SEED_STRIDE = 1000  # image seeds of one (round, layout, workload) span at most this many


@dataclass(frozen=True)
class Workload:
    name: str
    family: str
    multi_image: bool  # --images-per-request images a request, else one
    concurrency: int
    layouts: tuple[str, ...]


WORKLOADS = (
    Workload("llava_images_c1", "llava", True, 1, ("single", "epd")),
    Workload("llava_images_c4", "llava", True, 4, ("single", "epd")),
    Workload("qwen2_vl_images_c1", "qwen2_vl", True, 1, ("single", "epd")),
    Workload("qwen2_vl_images_c4", "qwen2_vl", True, 4, ("single", "epd")),
    Workload("llava_1img_c8", "llava", False, 8, ("single", "dp2", "tp2")),
)
LAYOUT_ORDER = ("single", "epd", "dp2", "tp2")

# From each server's /metrics, summed over labels: what its time went to.
BUSY_SERIES = {
    "step_s": ("vlmd_engine_step_seconds_sum",),
    "encoder_s": ("vlmd_encoder_forward_seconds_sum",),
    "preprocess_s": ("vlmd_media_fetch_seconds_sum", "vlmd_media_preprocess_seconds_sum"),
    "encodes": ("vlmd_encoder_forwards_total",),
}


@dataclass
class Layout:
    name: str
    # (role, command, env, port), started in this order; the last one's port takes the requests.
    processes: list[tuple[str, list[str], dict, int]]
    metrics: dict[str, str] = field(default_factory=dict)  # role -> base URL whose /metrics to read

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.processes[-1][3]}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llava-dir", help="the small LLaVA (default: built once under vlmd's cache)")
    parser.add_argument("--qwen-dir", help="the tiny Qwen2-VL (default: built once under vlmd's cache)")
    parser.add_argument("--images-per-request", type=int, default=4, help="images a request in the *_images_* "
                                                                          "workloads")
    parser.add_argument("--requests-images", type=int, default=16, help="requests per *_images_* workload")
    parser.add_argument("--requests-1img", type=int, default=32, help="requests per single-image workload")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--cores", default=None, help="the two cores, e.g. 0,1 (default: the first two this "
                                                      "process may use)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="every layout measured ROUNDS times, the layout order reversed each round, "
                             "since this host's speed drifts within minutes; figures are medians over the "
                             "rounds, each round's req/s is kept")
    parser.add_argument("--only", nargs="+", choices=[w.name for w in WORKLOADS], help="these workloads only")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000, help="image seed base")
    parser.add_argument("--port", type=int, default=8420, help="the front port; a layout's others follow it")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="each server's (each rank's) KV cache")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--vlmd-flag", action="append", default=[], help="extra flag for every vlmd serve")
    args = parser.parse_args(argv)
    for name in ("images_per_request", "requests_images", "requests_1img", "output_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.images_per_request * (max(args.requests_images, args.requests_1img) + 2) > SEED_STRIDE:
        parser.error(f"at most {SEED_STRIDE} images a workload, warm-up and probe included "
                     f"(image seeds must not overlap)")
    if args.cores is not None:
        cores = args.cores.split(",")
        if len(cores) != 2 or not all(core.isdigit() for core in cores) or cores[0] == cores[1]:
            parser.error("--cores: two distinct core numbers, e.g. 0,1")
        args.cores = [int(core) for core in cores]
    return args


def image_seeds(base: int, round_index: int, layout: str, workload: str, count: int) -> list[int]:
    """``count`` seeds that no other (round, layout, workload) of this run uses."""
    workload_index = [w.name for w in WORKLOADS].index(workload)
    start = base + SEED_STRIDE * (1 + workload_index + len(WORKLOADS) * (LAYOUT_ORDER.index(layout)
                                                                         + len(LAYOUT_ORDER) * round_index))
    return list(range(start, start + count))


def chat_body(image_urls: list[str], output_tokens: int, stream: bool = True) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    content.append({"type": "text", "text": "Describe these images." if len(image_urls) > 1 else "Describe this image."})
    return {"model": "bench", "messages": [{"role": "user", "content": content}], "max_tokens": output_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream}


async def run_bodies(url: str, concurrency: int, bodies: list[dict]) -> dict:
    """bench_chat.run_level's loop over prepared bodies (its client sends one image a request),
    with time per output token taken per request: (last token - first) / (tokens - 1). The
    median of all inter-token gaps (run_level's ``itl_p50_s``) is wrong behind a proxy that
    forwards several chunks in one write (vllm-router does): most gaps then read as ~0."""
    queue = list(bodies)
    results = []
    connector = aiohttp.TCPConnector(force_close=True)  # a connection per request, as run_level
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=connector) as session:
        async def worker():
            while queue:
                results.append(await stream_chat(session, url, queue.pop(0)))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"req_per_s": round(len(bodies) / elapsed, 3),
            "ttft_p50_s": round(statistics.median(r[0] for r in results), 4),
            "tpot_p50_s": median_or_none([sum(gaps) / len(gaps) for _, gaps, _ in results if gaps]),
            "itl_p50_s": median_or_none([gap for result in results for gap in result[1]]),
            "wall_s": round(elapsed, 2)}


def median_or_none(values: list[float]) -> float | None:
    return round(statistics.median(values), 5) if values else None


def prompt_tokens(url: str, body: dict) -> int | None:
    """``usage.prompt_tokens`` of ``body`` sent non-streamed for one token."""
    one = {**body, "max_tokens": 1, "stream": False}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(one).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read()).get("usage", {}).get("prompt_tokens")


def parse_metrics(text: str) -> dict[str, float]:
    """The ``BUSY_SERIES`` totals in a Prometheus text exposition (labels summed over)."""
    wanted = {series: key for key, names in BUSY_SERIES.items() for series in names}
    totals = dict.fromkeys(BUSY_SERIES, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            totals[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def busy(layout: Layout, started: list) -> dict[str, dict[str, float]]:
    """Each server's /metrics totals, and the CPU seconds of each started process group
    (the encoder-only server does its work between steps, which the step histograms miss)."""
    snapshot = {}
    for role, url in layout.metrics.items():
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            snapshot[role] = parse_metrics(response.read().decode())
    snapshot["cpu_s"] = {role: group_cpu_seconds(process.pid)
                         for (role, *_), process in zip(layout.processes, started)}
    return snapshot


def busy_delta(before: dict, after: dict) -> dict:
    return {role: {key: round(after[role][key] - before[role][key], 3) for key in before[role]} for role in before}


def vlmd_command(model_dir: str, port: int, flags: list[str], pin: int | None = None) -> list[str]:
    command = [sys.executable, "-m", "vlmd", "serve", model_dir, "--port", str(port), "--served-model-name", "bench",
               *flags]
    return ["taskset", "-c", str(pin), *command] if pin is not None else command


def build_layout(name: str, model_dir: str, args) -> Layout:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    pinned = {**env, "OMP_NUM_THREADS": "1"}  # as dp.py: libraries' own OpenMP teams sized to the core
    common = ["--kv-cache-gb", str(args.kv_cache_gb), "--preprocess-timeout", "600", *args.vlmd_flag]
    port, (first, second) = args.port, args.cores
    if name == "single":
        return Layout(name, [("server", vlmd_command(model_dir, port, ["--torch-threads", "2", *common]), env, port)],
                      {"server": f"http://127.0.0.1:{port}"})
    if name == "epd":
        encoder = vlmd_command(model_dir, port + 1, ["--encoder-only", "--torch-threads", "1", *common], first)
        language = vlmd_command(model_dir, port, [
            "--encoder-urls", f"http://127.0.0.1:{port + 1}", "--encoder-timeout-s", "600",
            "--encoder-fallback", "fail", "--torch-threads", "1", *common], second)
        return Layout(name, [("encoder", encoder, pinned, port + 1), ("language", language, pinned, port)],
                      {"encoder": f"http://127.0.0.1:{port + 1}", "language": f"http://127.0.0.1:{port}"})
    if name == "dp2":
        command = [sys.executable, str(DP_SCRIPT), "--replicas", "2", "--cores", f"{first},{second}",
                   "--base-port", str(port + 1), "--port", str(port), "--router-metrics-port", str(port + 50),
                   "--", model_dir, "--served-model-name", "bench", *common]
        return Layout(name, [("dp", command, env, port)],
                      {f"replica{i}": f"http://127.0.0.1:{port + 1 + i}" for i in range(2)})
    if name == "tp2":
        command = vlmd_command(model_dir, port, ["--tensor-parallel-size", "2", *common])
        # vlmd pins its ranks to the cores it may use: give it exactly the two.
        command = ["taskset", "-c", f"{first},{second}", *command]
        return Layout(name, [("server", command, env, port)], {"server": f"http://127.0.0.1:{port}"})
    raise ValueError(f"unknown layout {name!r}")


def measure_layout(layout: Layout, workloads: list[Workload], round_index: int, args) -> dict[str, dict]:
    """Start ``layout``, run ``workloads`` against it, stop it: workload name -> figures."""
    started, results = [], {}
    try:
        startup = time.monotonic()
        for role, command, env, port in layout.processes:
            process, _ = start(f"{layout.name}-{role}", command, env, port, args.startup_timeout)
            started.append(process)
        startup_s = round(time.monotonic() - startup, 1)
        for workload in workloads:
            per_request = images_of(workload, args)
            seeds = image_seeds(args.seed, round_index, layout.name, workload.name,
                                per_request * (requests_of(workload, args) + 2))
            images = [make_jpeg(seed, args.width, args.height) for seed in seeds]
            warm, probe, images = images[:per_request], images[per_request:2 * per_request], images[2 * per_request:]
            asyncio.run(run_bodies(layout.url, 1, [chat_body(warm, 4)]))  # warm-up, outside the figures
            tokens = prompt_tokens(layout.url, chat_body(probe, 1))
            before = busy(layout, started)
            bodies = [chat_body(images[i:i + per_request], args.output_tokens)
                      for i in range(0, len(images), per_request)]
            level = asyncio.run(run_bodies(layout.url, workload.concurrency, bodies))
            results[workload.name] = {**level, "prompt_tokens": tokens, "startup_s": startup_s,
                                      "busy": busy_delta(before, busy(layout, started))}
            print(f"  {workload.name:18s} {layout.name:6s} {level['req_per_s']:.3f} req/s "
                  f"ttft {level['ttft_p50_s']:.3f} s tpot {level['tpot_p50_s']} s", file=sys.stderr, flush=True)
        return results
    finally:
        for process in reversed(started):  # the language server before its encoder server
            stop(process)


def requests_of(workload: Workload, args) -> int:
    return args.requests_images if workload.multi_image else args.requests_1img


def images_of(workload: Workload, args) -> int:
    return args.images_per_request if workload.multi_image else 1


def median_figures(runs: list[dict]) -> dict:
    """One (workload, layout)'s figures over its rounds: medians, and each round's req/s."""
    figures = {key: statistics.median(run[key] for run in runs)
               for key in ("req_per_s", "ttft_p50_s", "tpot_p50_s", "itl_p50_s", "wall_s") if runs[0].get(key) is not None}
    figures = {key: round(value, 5) for key, value in figures.items()}
    figures.setdefault("tpot_p50_s", None)
    figures["prompt_tokens"] = runs[0]["prompt_tokens"]
    figures["startup_s"] = runs[0]["startup_s"]
    figures["busy"] = runs[0]["busy"] if len(runs) == 1 else [run["busy"] for run in runs]
    for key in ("req_per_s", "ttft_p50_s", "tpot_p50_s"):  # each round's too: the host drifts between them
        figures[f"{key}_rounds"] = [run[key] for run in runs]
    return figures


def summarize(lines: list[dict]) -> dict:
    """Each workload's layouts against ``single``: req/s layout/single, TTFT and time per output
    token single/layout (> 1: the layout is better); and the best layout by each figure."""
    by_workload: dict[str, dict[str, dict]] = {}
    for line in lines:
        by_workload.setdefault(line["workload"], {})[line["layout"]] = line
    summary = {}
    for workload, layouts in by_workload.items():
        entry: dict = {}
        base = layouts.get(BASELINE)
        for name, line in layouts.items():
            if name == BASELINE or base is None:
                continue
            entry[f"{name}_vs_{BASELINE}"] = {
                "req_per_s": ratio(line["req_per_s"], base["req_per_s"]),
                "ttft_p50": ratio(base["ttft_p50_s"], line["ttft_p50_s"]),
                "tpot_p50": ratio(base["tpot_p50_s"], line["tpot_p50_s"]),
                # Round i of both ran minutes apart at most: the ratio least moved by the drift.
                "req_per_s_rounds": [ratio(ours, theirs) for ours, theirs in
                                     zip(line.get("req_per_s_rounds", []), base.get("req_per_s_rounds", []))],
            }
        entry["best"] = {
            "req_per_s": max(layouts, key=lambda name: layouts[name]["req_per_s"]),
            "ttft_p50": min(layouts, key=lambda name: layouts[name]["ttft_p50_s"]),
            "tpot_p50": min((name for name in layouts if layouts[name]["tpot_p50_s"] is not None),
                            key=lambda name: layouts[name]["tpot_p50_s"], default=None),
        }
        summary[workload] = entry
    return summary


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 3)


def host() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in
                  subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                  if line.startswith("Model name")), None)
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "load_avg": [round(v, 2) for v in os.getloadavg()]}


def model_dirs(args, families: set[str]) -> dict[str, str]:
    from vlmd.config import cache_dir

    wanted = {"llava": (args.llava_dir, "small"), "qwen2_vl": (args.qwen_dir, "tiny")}
    dirs = {}
    for family in sorted(families):
        explicit, size = wanted[family]
        if explicit is None:
            target = cache_dir() / "bench" / f"{family}-{size}-seed0"
            if not (target / "config.json").exists():
                from vlmd.tiny import build_tiny

                build_tiny(family, target, seed=0, size=size)
            explicit = str(target)
        dirs[family] = explicit
    return dirs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cores is None:
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) < 2:
            raise SystemExit(f"bench_layouts: two cores needed, this process may use {allowed}")
        args.cores = allowed[:2]
    workloads = [w for w in WORKLOADS if args.only is None or w.name in args.only]
    dirs = model_dirs(args, {w.family for w in workloads})
    host_before = host()
    runs: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(args.rounds):
        for family, model_dir in dirs.items():
            names = [name for name in LAYOUT_ORDER if any(name in w.layouts and w.family == family for w in workloads)]
            for name in names if round_index % 2 == 0 else names[::-1]:
                chosen = [w for w in workloads if w.family == family and name in w.layouts]
                print(f"round {round_index}: {family} {name}", file=sys.stderr, flush=True)
                measured = measure_layout(build_layout(name, model_dir, args), chosen, round_index, args)
                for workload, figures in measured.items():
                    runs.setdefault((workload, name), []).append(figures)
    lines = []
    for workload in workloads:
        for name in LAYOUT_ORDER:
            if (workload.name, name) in runs:
                line = {"workload": workload.name, "layout": name, "model": dirs[workload.family],
                        "images_per_request": images_of(workload, args), "concurrency": workload.concurrency,
                        "requests": requests_of(workload, args), "output_tokens": args.output_tokens,
                        **median_figures(runs[(workload.name, name)])}
                lines.append(line)
                print(json.dumps(line), flush=True)
    print(json.dumps({"summary": summarize(lines), "host_before": host_before, "host_after": host(),
                      "seed": args.seed, "rounds": args.rounds, "image": f"{args.width}x{args.height}",
                      "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)])}),
          flush=True)


if __name__ == "__main__":
    main()
