"""TTFT for first-time vs repeated images, one request at a time (c1), one JSON line.

Phase "cold": every request brings a new 640x480 JPEG. Phase "repeat": every request
asks a new question about an image the server has already seen (a multi-turn chat or a
document asked many questions): processor, encoder and prefix caches should all hit.

    python contrib/bench/bench_mm_cache.py --size tiny --num-requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chat import make_jpeg, start_server  # noqa: E402


async def ttft(session, url, image_url, question, output_tokens) -> tuple[float, int]:
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": question}]}],
        "max_tokens": output_tokens, "ignore_eos": True, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = None
    cached = 0
    async with session.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                            headers={"Content-Type": "application/json"}) as response:
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, cached


async def run(url: str, num_requests: int, output_tokens: int) -> dict:
    images = [make_jpeg(1000 + i, 640, 480) for i in range(num_requests)]
    async with aiohttp.ClientSession() as session:
        await ttft(session, url, make_jpeg(1, 640, 480), "warm up", 2)
        cold = [await ttft(session, url, image, "Describe this image.", output_tokens) for image in images]
        repeat = [await ttft(session, url, image, f"Question {i}: what else?", output_tokens)
                  for i, image in enumerate(images)]
    cold_p50 = statistics.median(t for t, _ in cold)
    repeat_p50 = statistics.median(t for t, _ in repeat)
    return {
        "cold_ttft_p50_s": round(cold_p50, 4),
        "repeat_ttft_p50_s": round(repeat_p50, 4),
        "speedup": round(cold_p50 / repeat_p50, 2),
        "repeat_cached_tokens_p50": statistics.median(c for _, c in repeat),
        "requests_per_phase": num_requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--port", type=int, default=8312)
    parser.add_argument("--server-flag", action="append", default=[])
    args = parser.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        from vlmd.config import cache_dir
        from vlmd.tiny import build_tiny

        target = cache_dir() / "bench" / f"llava-{args.size}-seed0"
        if not (target / "config.json").exists():
            build_tiny("llava", target, seed=0, size=args.size)
        model_dir = str(target)
    process = start_server(model_dir, args.port, args.server_flag)
    try:
        result = asyncio.run(run(f"http://127.0.0.1:{args.port}", args.num_requests, args.output_tokens))
    finally:
        process.terminate()
        process.wait(30)
    print(orjson.dumps({"model": args.size if args.model_dir is None else model_dir,
                        "server_flags": args.server_flag, **result}).decode())


if __name__ == "__main__":
    main()
