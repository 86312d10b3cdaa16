"""A light request beside an image flood (issue 47): where a short request's time goes.

The flood: ``--flood-requests`` (12) streaming chats at ``--concurrency`` (4), each with
``--images`` (3) fresh ``--width`` x ``--height`` (2048x1536) JPEGs (distinct pixels, so no
cache can help), ``--flood-tokens`` output tokens. Beside it, from the flood's start to its
end, a 4-token text request ("hello") every ``--text-interval`` (0.5) seconds. Prints one
JSON line: the flood's req/s, the text requests' TTFT p50/p90 (first content chunk, as
vLLM's benchmark stamps it), and, where the server exports ``vlmd_request_stage_seconds``,
each input's stages (mean ms a request and share of its time to first token) over the run.

    python contrib/bench/flood.py --url http://127.0.0.1:8000 --model vlmd-tiny-llava
    python contrib/bench/flood.py --model-dir /path/to/llava --server-flag=--preprocess-threads=4

With ``--peer-url`` (and ``--peer-model``, its served name), the same flood with the same
images is then sent to that server too (vLLM's, started beforehand on the same checkpoint),
and the line holds both runs and their ratios (vlmd over the peer):

    python contrib/bench/flood.py --model-dir DIR --peer-url http://127.0.0.1:8100 --peer-model m
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chat import make_jpeg, start_server, stream_chat, tiny_llava_dir  # noqa: E402

STAGE_METRIC = "vlmd_request_stage_seconds"


def stage_sums(url: str) -> dict[tuple[str, str, str], float]:
    """{(input, stage, "sum"|"count"): value} of the stage histogram now (empty if absent)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    found = {}
    for line in text.splitlines():
        for suffix in ("sum", "count"):
            prefix = f"{STAGE_METRIC}_{suffix}{{"
            if line.startswith(prefix):
                labels_text, value = line[len(prefix):].rsplit("} ", 1)
                labels = dict(part.split("=", 1) for part in labels_text.split(","))
                found[(labels["input"].strip('"'), labels["stage"].strip('"'), suffix)] = float(value)
    return found


def stage_table(before: dict, after: dict) -> dict:
    """Per input: requests, mean ms per stage, and each stage's share of the stages' total."""
    table = {}
    for kind in sorted({key[0] for key in after}):
        stages = sorted({key[1] for key in after if key[0] == kind})
        sums = {stage: after.get((kind, stage, "sum"), 0.0) - before.get((kind, stage, "sum"), 0.0) for stage in stages}
        count = max(after.get((kind, stage, "count"), 0.0) - before.get((kind, stage, "count"), 0.0) for stage in stages)
        total = sum(sums.values())
        if not count:
            continue
        table[kind] = {
            "requests": int(count),
            "ttft_mean_ms": round(1000 * total / count, 1),
            "stages_mean_ms": {stage: round(1000 * sums[stage] / count, 1) for stage in stages},
            "stages_share": {stage: round(sums[stage] / total, 3) if total else 0.0 for stage in stages},
        }
    return table


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * (len(ordered) - 1) + 0.5))]


async def flood(url: str, model: str, args, images: list[str]) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    queue = list(range(args.flood_requests))
    text_ttfts: list[float] = []
    flood_ttfts: list[float] = []
    done = asyncio.Event()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def flood_worker():
            while queue:
                index = queue.pop(0)
                parts = [{"type": "image_url", "image_url": {"url": images[index * args.images + k]}}
                         for k in range(args.images)]
                body = {"model": model, "messages": [{"role": "user", "content": [
                    *parts, {"type": "text", "text": "Describe these images."}]}],
                    "max_tokens": args.flood_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
                flood_ttfts.append((await stream_chat(session, url, body))[0])

        async def one_text():
            body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                    "ignore_eos": True, "temperature": 0, "stream": True}
            text_ttfts.append((await stream_chat(session, url, body))[0])

        async def text_sender():
            pending = []
            while not done.is_set():
                pending.append(asyncio.ensure_future(one_text()))
                try:
                    await asyncio.wait_for(done.wait(), args.text_interval)
                except TimeoutError:
                    pass
            await asyncio.gather(*pending)

        started = time.perf_counter()
        sender = asyncio.ensure_future(text_sender())
        await asyncio.gather(*(flood_worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
        done.set()
        await sender
    return {
        "flood_req_per_s": round(args.flood_requests / elapsed, 3),
        "flood_wall_s": round(elapsed, 2),
        "flood_ttft_p50_s": round(statistics.median(flood_ttfts), 3),
        "text_requests": len(text_ttfts),
        "text_ttft_p50_s": round(statistics.median(text_ttfts), 3),
        "text_ttft_p90_s": round(percentile(text_ttfts, 0.9), 3),
        "text_ttft_max_s": round(max(text_ttfts), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server (default: start vlmd on --model-dir)")
    parser.add_argument("--model", default="bench", help="model name to send with --url")
    parser.add_argument("--model-dir", help="checkpoint to serve (default: a tiny LLaVA built once)")
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--server-flag", action="append", default=[], help="extra flag for vlmd serve (repeatable)")
    parser.add_argument("--flood-requests", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--images", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--height", type=int, default=1536)
    parser.add_argument("--flood-tokens", type=int, default=16)
    parser.add_argument("--text-interval", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1000, help="first image seed (another run: other pixels)")
    parser.add_argument("--peer-url", help="another server (vLLM) to send the same flood to, after vlmd's")
    parser.add_argument("--peer-model", default="m", help="the model name to send to --peer-url")
    args = parser.parse_args()

    process = None
    url, model = args.url, args.model
    if url is None:
        process = start_server(args.model_dir or tiny_llava_dir("tiny"), args.port, args.server_flag)
        url, model = f"http://127.0.0.1:{args.port}", "bench"
    try:
        count = args.flood_requests * args.images
        images = [make_jpeg(args.seed + index, args.width, args.height) for index in range(count + args.images)]
        result = measure(url, model, args, images, count)
        result.update(image=f"{args.width}x{args.height}", images_per_request=args.images,
                      concurrency=args.concurrency, flood_requests=args.flood_requests,
                      server_flags=args.server_flag)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    if args.peer_url:
        peer = measure(args.peer_url, args.peer_model, args, images, count)
        ratios = {"flood_req_per_s": round(result["flood_req_per_s"] / peer["flood_req_per_s"], 3)}
        for key in ("text_ttft_p50_s", "text_ttft_p90_s"):  # vlmd's over the peer's: under 1 is faster
            ratios[key] = round(result[key] / peer[key], 3) if peer[key] else None
        result = {"vlmd": result, "peer": {**peer, "url": args.peer_url}, "ratios": ratios}
    print(orjson.dumps(result).decode())


def measure(url: str, model: str, args, images: list[str], count: int) -> dict:
    """One warm-up of each kind outside the measurement (its own images), then the flood;
    the stage table where the server exports vlmd's stage histograms."""
    warm = argparse.Namespace(**{**vars(args), "flood_requests": 1, "concurrency": 1})
    asyncio.run(flood(url, model, warm, images[count:]))
    before = stage_sums(url)
    result = asyncio.run(flood(url, model, args, images))
    result["stages"] = stage_table(before, stage_sums(url))
    return result


if __name__ == "__main__":
    main()
