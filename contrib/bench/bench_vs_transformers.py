"""vlmd against transformers' own ``generate`` (batch 1) on the same checkpoint, as one JSON line.

For a family no serving peer runs (Llama 3.2 Vision: vLLM removed it in 0.10.2), the
reference is transformers itself, used the way its documentation shows: the processor with
the checkpoint's chat template, then ``generate`` one request at a time (float32, greedy,
``min_new_tokens`` = ``max_new_tokens`` so both produce the same number of tokens; the PIL
image processor, as the parity tests use). Each request is timed from the image's bytes to the
last token; its TTFT is a second ``generate`` with one new token. vlmd serves the same
requests over HTTP (streaming, ``ignore_eos``) at c1 and at c8. Both see the same 640x480
JPEGs, fresh per round; the two alternate ``--rounds`` times (vlmd's server is stopped with
SIGSTOP while transformers runs, so its idle threads take nothing) and figures are medians
over the rounds. Ratios > 1 mean vlmd is better (req/s ours / theirs, TTFT theirs / ours).

    python contrib/bench/bench_vs_transformers.py --family mllama --size small
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chat import make_jpeg, run_level  # noqa: E402
from side_by_side import group_rss_gib, start, stop, vlmd_command  # noqa: E402

PROMPT = "Describe this image."


def load_reference(model_dir: str):
    """transformers' model (float32, eval) and processor with the PIL image backend."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir, backend="pil")
    return model, processor


def reference_request(model, processor, image_url: str, new_tokens: int) -> float:
    """Seconds for one request: decode the JPEG, process, generate ``new_tokens`` tokens."""
    import torch
    from PIL import Image

    started = time.perf_counter()
    image = Image.open(io.BytesIO(base64.b64decode(image_url.split(",", 1)[1]))).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, images=[image], return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if output.shape[1] - inputs["input_ids"].shape[1] != new_tokens:
        raise RuntimeError(f"transformers produced {output.shape[1] - inputs['input_ids'].shape[1]} tokens, "
                           f"not {new_tokens}")
    return time.perf_counter() - started


def reference_round(model, processor, images: list[str], output_tokens: int) -> dict:
    ttfts = [reference_request(model, processor, image, 1) for image in images]
    started = time.perf_counter()
    for image in images:
        reference_request(model, processor, image, output_tokens)
    elapsed = time.perf_counter() - started
    return {"req_per_s": round(len(images) / elapsed, 3), "ttft_p50_s": round(statistics.median(ttfts), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="mllama")
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--model-dir")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000)
    parser.add_argument("--port", type=int, default=8331)
    parser.add_argument("--vlmd-flag", action="append", default=[])
    args = parser.parse_args()
    if args.num_requests < 1 or args.rounds < 1:
        parser.error("--num-requests and --rounds must be at least 1")

    model_dir = args.model_dir
    if model_dir is None:
        from vlmd.config import cache_dir
        from vlmd.tiny import build_tiny

        target = cache_dir() / "bench" / f"{args.family}-{args.size}-seed0"
        if not (target / "config.json").exists():
            build_tiny(args.family, target, seed=0, size=args.size)
        model_dir = str(target)

    model, processor = load_reference(model_dir)
    command, env = vlmd_command(model_dir, args.port, "float32", args.vlmd_flag)
    process, startup = start("vlmd", command, env, args.port, 600)
    url = f"http://127.0.0.1:{args.port}"
    rounds: dict[str, list[dict]] = {"transformers": [], "vlmd_c1": [], "vlmd_c8": []}
    try:
        warm = make_jpeg(args.seed - 1, args.width, args.height)
        asyncio.run(run_level(url, "bench", 1, 1, 4, [warm]))
        reference_request(model, processor, warm, 4)
        for round_index in range(args.rounds):
            base = args.seed + 10_000 * (round_index + 1)
            images = [make_jpeg(base + i, args.width, args.height) for i in range(args.num_requests)]
            os.killpg(process.pid, signal.SIGSTOP)
            try:
                rounds["transformers"].append(reference_round(model, processor, images, args.output_tokens))
            finally:
                os.killpg(process.pid, signal.SIGCONT)
            for concurrency, offset in ((1, 1000), (8, 2000)):  # fresh images: no cache helps vlmd
                fresh = [make_jpeg(base + offset + i, args.width, args.height) for i in range(args.num_requests)]
                level = asyncio.run(run_level(url, "bench", concurrency, args.num_requests, args.output_tokens, fresh))
                rounds[f"vlmd_c{concurrency}"].append({key: level[key] for key in ("req_per_s", "ttft_p50_s", "itl_p50_s")})
        rss = group_rss_gib(process.pid)
    finally:
        stop(process)

    medians = {name: {key: round(statistics.median(run[key] for run in runs), 4) for key in runs[0]}
               for name, runs in rounds.items()}
    reference = medians["transformers"]
    print(json.dumps({
        "model": model_dir, "num_requests": args.num_requests, "output_tokens": args.output_tokens,
        "rounds": args.rounds, "seed": args.seed, "vlmd_startup_s": round(startup, 1), "vlmd_rss_gib": rss,
        "medians": medians, "per_round": rounds,
        "vlmd_advantage": {
            "c1_req_per_s": round(medians["vlmd_c1"]["req_per_s"] / reference["req_per_s"], 3),
            "c8_req_per_s_vs_batch1": round(medians["vlmd_c8"]["req_per_s"] / reference["req_per_s"], 3),
            "c1_ttft": round(reference["ttft_p50_s"] / medians["vlmd_c1"]["ttft_p50_s"], 3),
        },
    }))


if __name__ == "__main__":
    main()
