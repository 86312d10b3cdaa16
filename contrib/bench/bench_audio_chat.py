"""Audio-chat throughput and TTFT: Qwen2-Audio (tiny or small random checkpoint) through vlmd.

Each request carries its own clip (``input_audio``, 16 kHz 16-bit WAV of ``--seconds``,
distinct samples so no cache can help), ``ignore_eos`` and a fixed number of output tokens.
Prints one JSON line:

    {"model": ..., "results": {"c1": {"req_per_s": .., "ttft_p50_s": .., "itl_p50_s": ..}, "c8": {...}}}

    python contrib/bench/bench_audio_chat.py --size tiny --concurrency 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import time

import aiohttp
import numpy as np
import orjson
import soundfile as sf

from bench_chat import start_server, stream_chat


def make_wav(seed: int, seconds: float) -> str:
    t = np.arange(int(seconds * 16000)) / 16000
    rng = np.random.default_rng(seed)
    samples = 0.3 * np.sin(2 * np.pi * (150 + seed % 400) * t) + 0.03 * rng.standard_normal(t.shape[0])
    buffer = io.BytesIO()
    sf.write(buffer, samples.astype(np.float32), 16000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buffer.getvalue()).decode()


async def one_request(session, url, model, audio_b64, output_tokens):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": audio_b64, "format": "wav"}},
            {"type": "text", "text": "What is this sound?"},
        ]}],
        "max_tokens": output_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
    }
    ttft, gaps, _ = await stream_chat(session, url, body)
    return ttft, gaps


async def run_level(url, model, concurrency, clips, output_tokens):
    queue = list(range(len(clips)))
    results = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def worker():
            while queue:
                results.append(await one_request(session, url, model, clips[queue.pop(0)], output_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    gaps = [g for r in results for g in r[1]]
    return {
        "requests": len(clips), "req_per_s": round(len(clips) / elapsed, 3),
        "ttft_p50_s": round(statistics.median(r[0] for r in results), 4),
        "itl_p50_s": round(statistics.median(gaps), 5) if gaps else None, "wall_s": round(elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="checkpoint to serve (default: build one with --size)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0, help="clip length (at most 30)")
    parser.add_argument("--port", type=int, default=8312)
    parser.add_argument("--server-flag", action="append", default=[], help="extra flag for vlmd serve (repeatable)")
    args = parser.parse_args()

    model_dir = args.model_dir
    if model_dir is None:
        from vlmd.config import cache_dir
        from vlmd.tiny import build_tiny

        cache = cache_dir() / "bench"
        target = cache / f"qwen2_audio-{args.size}-seed0"
        if not (target / "config.json").exists():
            build_tiny("qwen2_audio", target, seed=0, size=args.size)
        model_dir = str(target)
    process = start_server(model_dir, args.port, args.server_flag)
    url = f"http://127.0.0.1:{args.port}"
    try:
        clips = [make_wav(seed, args.seconds) for seed in range(args.num_requests * len(args.concurrency) + 1)]
        asyncio.run(run_level(url, "bench", 1, clips[-1:], 4))  # warm-up, not measured
        results = {}
        for index, level in enumerate(args.concurrency):
            level_clips = clips[index * args.num_requests : (index + 1) * args.num_requests]
            results[f"c{level}"] = asyncio.run(run_level(url, "bench", level, level_clips, args.output_tokens))
        print(orjson.dumps({"model": args.model_dir or f"qwen2_audio-{args.size}", "output_tokens": args.output_tokens,
                            "clip_seconds": args.seconds, "server_flags": args.server_flag,
                            "results": results}).decode())
    finally:
        process.terminate()
        process.wait(30)


if __name__ == "__main__":
    main()
