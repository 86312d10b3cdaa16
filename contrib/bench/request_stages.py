"""A request's time to first token, stage by stage, under load: starts ``vlmd serve`` on a
checkpoint, warms it, sends ``--num-requests`` streaming image chats at ``--concurrency``
(one JPEG for every request with ``--repeated``, else a fresh one each), and prints one JSON
line with the throughput and the mean of each stage of ``vlmd_request_stage_seconds`` (D109)
over those requests, read from ``/metrics`` before and after:

    python contrib/bench/request_stages.py --model-dir ~/.cache/vlmd/bench/qwen2_vl-small-seed0 \\
        --concurrency 8 --repeated --num-requests 96
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import urllib.request

from bench_chat import make_jpeg, run_level, start_server

STAGE_LINE = re.compile(r'vlmd_request_stage_seconds_(sum|count)\{(.*)\} (\S+)')


def stage_totals(url: str) -> dict[tuple[str, str], float]:
    """(stage, "sum" | "count") -> value, for requests with media."""
    totals = {}
    for line in urllib.request.urlopen(url + "/metrics").read().decode().splitlines():
        match = STAGE_LINE.match(line)
        if match and 'input="media"' in match.group(2):
            stage = re.search(r'stage="(\w+)"', match.group(2)).group(1)
            totals[(stage, match.group(1))] = float(match.group(3))
    return totals


def cpu_model() -> str:
    """lscpu's model line and /proc/cpuinfo's family and model (hosts of one name differ)."""
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "?")
    info = open("/proc/cpuinfo").read()
    family, model = (re.search(rf"^{key}\s*: (\d+)", info, re.M) for key in ("cpu family", "model"))
    return f"{name} (family {family.group(1) if family else '?'} model {model.group(1) if model else '?'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--repeated", action="store_true", help="one image for every request")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--port", type=int, default=8399)
    parser.add_argument("--server-flag", action="append", default=[], help="extra flag for vlmd serve (repeatable)")
    args = parser.parse_args()

    server = start_server(args.model_dir, args.port, ["--dtype", args.dtype, "--max-model-len", "2048",
                                                      *args.server_flag])
    try:
        url = f"http://127.0.0.1:{args.port}"
        if args.repeated:
            warm = images = [make_jpeg(7, 640, 480)]
        else:
            warm = [make_jpeg(900 + i, 640, 480) for i in range(16)]
            images = [make_jpeg(100 + i, 640, 480) for i in range(args.num_requests)]
        asyncio.run(run_level(url, "bench", args.concurrency, 16, args.output_tokens, warm))
        before = stage_totals(url)
        load = asyncio.run(run_level(url, "bench", args.concurrency, args.num_requests, args.output_tokens, images))
        after = stage_totals(url)
    finally:
        server.kill()
    stages_ms = {}
    for (stage, kind), total in after.items():
        if kind == "sum":
            count = after[(stage, "count")] - before.get((stage, "count"), 0.0)
            stages_ms[stage] = round(1000 * (total - before.get((stage, kind), 0.0)) / max(count, 1.0), 2)
    print(json.dumps({
        "bench": "request_stages", "model": args.model_dir, "dtype": args.dtype, "cpu": cpu_model(),
        "concurrency": args.concurrency, "repeated": args.repeated, "load": load, "stage_ms": stages_ms,
        "ttft_mean_ms": round(sum(stages_ms.values()), 2),
    }))


if __name__ == "__main__":
    main()
