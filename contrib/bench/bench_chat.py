"""Image-chat throughput and TTFT against a running OpenAI-compatible server.

Starts ``vlmd serve`` on a tiny or small LLaVA checkpoint (or uses ``--url`` for any
server, e.g. vLLM's), sends ``--num-requests`` streaming chats at each concurrency, each
with its own 640x480 JPEG (distinct pixels, so no cache can help), ``ignore_eos`` and a
fixed number of output tokens, and prints one JSON line:

    {"model": ..., "results": {"c1": {"req_per_s": .., "ttft_p50_s": .., "itl_p50_s": ..}, "c8": {...}}}

    python contrib/bench/bench_chat.py --size tiny --concurrency 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson
from PIL import Image


def make_jpeg(seed: int, width: int, height: int) -> str:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x + seed) % 256, (y * 2 + seed) % 256, (x + y) % 256], axis=-1)
    pixels = ((base + rng.integers(0, 48, size=(height, width, 3))) % 256).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


async def one_request(session, url, model, image_url, output_tokens):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "text", "text": "Describe this image."},
        ]}],
        "max_tokens": output_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    return await stream_chat(session, url, body)


async def stream_chat(session, url, body):
    """POST one streaming chat body: (TTFT, inter-token gaps, seconds), shared by the benches."""
    start = time.perf_counter()
    token_times = []
    async with session.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                            headers={"Content-Type": "application/json"}) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:  # an error after the status line arrives as a chunk
                raise RuntimeError(f"error in the stream: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                token_times.append(time.perf_counter())
    ttft = token_times[0] - start if token_times else float("nan")
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    return ttft, gaps, time.perf_counter() - start


async def run_level(url, model, concurrency, num_requests, output_tokens, images):
    queue = list(range(num_requests))
    results = []
    timeout = aiohttp.ClientTimeout(total=3600)
    # A connection per request: llama.cpp's server closes a connection after a streamed answer,
    # and a client reusing it then fails its next request; the same for every server measured.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def worker():
            while queue:
                index = queue.pop(0)
                results.append(await one_request(session, url, model, images[index % len(images)], output_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    return {
        "requests": num_requests,
        "req_per_s": round(num_requests / elapsed, 3),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p90_s": round(sorted(ttfts)[int(0.9 * (len(ttfts) - 1))], 4),
        "itl_p50_s": round(statistics.median(gaps), 5) if gaps else None,
        "wall_s": round(elapsed, 2),
    }


def start_server(model_dir: str, port: int, flags: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "vlmd", "serve", model_dir, "--port", str(port),
               "--served-model-name", "bench", *flags]
    log = open(Path(tempfile.gettempdir()) / f"vlmd-bench-{port}.log", "wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    import urllib.request

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited; see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return process
        except OSError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError("server did not start")


def tiny_llava_dir(size: str) -> str:
    """The benches' default model: a tiny (or small) random LLaVA, built once into the cache."""
    from vlmd.config import cache_dir
    from vlmd.tiny import build_tiny

    target = cache_dir() / "bench" / f"llava-{size}-seed0"
    if not (target / "config.json").exists():
        build_tiny("llava", target, seed=0, size=size)
    return str(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="benchmark an already running server instead of starting vlmd")
    parser.add_argument("--model", default="bench", help="model name to send with --url")
    parser.add_argument("--model-dir", help="checkpoint to serve (default: build one with --size)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--server-flag", action="append", default=[], help="extra flag for vlmd serve (repeatable)")
    args = parser.parse_args()

    process = None
    url, model = args.url, args.model
    if url is None:
        process = start_server(args.model_dir or tiny_llava_dir(args.size), args.port, args.server_flag)
        url, model = f"http://127.0.0.1:{args.port}", "bench"
    try:
        images = [make_jpeg(seed, args.width, args.height) for seed in range(args.num_requests * len(args.concurrency) + 2)]
        # One warm-up request outside the measurement.
        asyncio.run(run_level(url, model, 1, 1, 4, images[-1:]))
        results = {}
        offset = 0
        for level in args.concurrency:
            level_images = images[offset : offset + args.num_requests]
            offset += args.num_requests
            results[f"c{level}"] = asyncio.run(
                run_level(url, model, level, args.num_requests, args.output_tokens, level_images)
            )
        print(orjson.dumps({"model": args.model_dir or (args.size if args.url is None else model),
                            "output_tokens": args.output_tokens, "image": f"{args.width}x{args.height}",
                            "server_flags": args.server_flag, "results": results}).decode())
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)


if __name__ == "__main__":
    main()
