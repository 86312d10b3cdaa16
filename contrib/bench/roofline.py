"""How far vlmd is from this host's physical floor, per workload, as one JSON line.

Measures the host's GEMM peak (fp32 and bf16 ``torch.mm``, 2048^3, all threads) and memory
read bandwidth (``sum`` over a 512 MiB tensor), before and after the load (the better of the
two counts: this host's speed drifts, and a slowed probe lowers the floor), derives each workload's floor from the
LLaVA checkpoint's config, then serves the checkpoint with vlmd and reports
``floor / measured`` (1.0 = at the floor):

- prefill: FLOPs of one 640x480-image request (vision tower up to the feature layer,
  projector, decoder over the whole prompt) / GEMM peak  vs  TTFT p50 at c1, new images.
  ``prefill_ttft_s`` counts the arithmetic the prompt needs: the decoder's last layer only
  computes K/V for every token and the rest for the last token alone (its other outputs
  feed nothing); ``prefill_ttft_full_model_s`` runs every layer over every token;
- decode c1 / c8: the larger of the bytes one step must read (every decoder weight once,
  plus the batch's K/V) / bandwidth and the step's arithmetic (every decoder product and
  the attention over each context, per decode) / GEMM peak  vs  time per output token at
  c1 / c8, one repeated image. Which of the two is longer depends on the host and the
  batch: both parts are in the JSON line (``decode_floor_parts_s``);
- c8 new images, per request: the prefill floor plus its share of batch-8 decode steps
  (``output_tokens - 1`` of them, 8 decodes a step)  vs  wall time / requests. The engine's
  own split (``vlmd_engine_step_seconds`` from ``/metrics``: seconds in prefill steps and
  in decode-only steps, per request) says which part is off its floor.

    python contrib/bench/roofline.py --size small --num-requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch
import urllib.request

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chat import make_jpeg, run_level, start_server  # noqa: E402


def gemm_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * size**3 / best


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    data = torch.ones(mib * 2**20 // 4)
    data.sum()
    return data.numel() * 4 / min(_timed(data.sum) for _ in range(repeats))


def probe_host() -> dict[str, float]:
    return {"gemm_fp32_gflops": round(gemm_peak(torch.float32) / 1e9, 1),
            "gemm_bf16_gflops": round(gemm_peak(torch.bfloat16) / 1e9, 1),
            "read_gb_s": round(read_bandwidth() / 1e9, 1)}


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def prefill_flops(config, prompt_tokens: int) -> dict[str, float]:
    vision, text = config.vision_config, config.text_config
    patches = (vision.image_size // vision.patch_size) ** 2
    n, h, i = patches + 1, vision.hidden_size, vision.intermediate_size
    layers = config.vision_feature_layer % (vision.num_hidden_layers + 1)
    vision_flops = 2 * patches * 3 * vision.patch_size**2 * h  # patch embedding
    vision_flops += layers * (2 * n * (4 * h * h + 2 * h * i) + 4 * n * n * h)
    image_tokens = patches if getattr(config, "vision_feature_select_strategy", "default") == "default" else n
    projector = 2 * image_tokens * (h * text.hidden_size + text.hidden_size**2)
    t, d = prompt_tokens, text.hidden_size
    head_dim = getattr(text, "head_dim", None) or d // text.num_attention_heads
    q, kv = text.num_attention_heads * head_dim, text.num_key_value_heads * head_dim
    per_token = d * (q + 2 * kv) + q * d + 3 * d * text.intermediate_size
    per_layer = 2 * t * per_token + 2 * t * t * q  # causal: half of 4
    logits = 2 * d * text.vocab_size  # of the last token only
    lm = text.num_hidden_layers * per_layer + logits
    # What the prompt needs: the last layer's output is used at the last token alone, so
    # there only the K/V products cover every token (later tokens attend to them).
    last_layer_needed = 2 * t * d * 2 * kv + 2 * (per_token - d * 2 * kv) + 4 * t * q
    lm_needed = (text.num_hidden_layers - 1) * per_layer + last_layer_needed + logits
    encoder = vision_flops + projector
    return {"vision": encoder, "lm": lm, "total": encoder + lm, "lm_needed": lm_needed, "needed": encoder + lm_needed}


def _decoder_shape(config) -> tuple[int, int, int]:
    """(decoder weights' elements, query width, key/value width) of the text decoder."""
    text = config.text_config
    d, inter = text.hidden_size, text.intermediate_size
    head_dim = getattr(text, "head_dim", None) or d // text.num_attention_heads
    q, kv = text.num_attention_heads * head_dim, text.num_key_value_heads * head_dim
    weights = text.num_hidden_layers * (d * (q + 2 * kv) + q * d + 3 * d * inter) + d * text.vocab_size
    return weights, q, kv


def decode_bytes(config, batch: int, context: int, element: int) -> float:
    weights, _, kv = _decoder_shape(config)
    kv_bytes = batch * context * config.text_config.num_hidden_layers * 2 * kv * element
    return weights * element + kv_bytes


def decode_flops(config, batch: int, context: int) -> float:
    """One decode step's arithmetic: each decode through every product, and its query
    against every key and value of its context in every layer."""
    weights, q, _ = _decoder_shape(config)
    return batch * (2 * weights + 4 * context * q * config.text_config.num_hidden_layers)


def prompt_tokens_of(url: str, image: str) -> int:
    body = {"model": "bench", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Describe this image."}]}]}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["usage"]["prompt_tokens"]


ENGINE_COUNTERS = ("vlmd_encoder_calls_total", "vlmd_encoder_forwards_total", "vlmd_engine_steps_total")


def engine_step_seconds(url: str) -> dict[str, float]:
    """Seconds the engine has spent in steps of each kind (``/metrics``), e.g. {"prefill": ..},
    and its counters of encoder calls, items encoded and steps (``ENGINE_COUNTERS``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    totals = {}
    for line in text.splitlines():
        if line.startswith("vlmd_engine_step_seconds_sum{"):
            labels, value = line.rsplit(" ", 1)
            totals[labels.split('kind="', 1)[1].split('"', 1)[0]] = float(value)
        elif line.split(" ", 1)[0] in ENGINE_COUNTERS:
            totals[line.split(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--model-dir")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8312)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000, help="first image seed (fresh per run)")
    args = parser.parse_args()
    from transformers import AutoConfig

    model_dir = args.model_dir
    if model_dir is None:
        from vlmd.config import cache_dir
        from vlmd.tiny import build_tiny

        model_dir = cache_dir() / "bench" / f"llava-{args.size}-seed0"
        if not (model_dir / "config.json").exists():
            build_tiny("llava", model_dir, seed=0, size=args.size)
    config = AutoConfig.from_pretrained(str(model_dir))
    dtype = getattr(torch, args.dtype)
    probes = [probe_host()]
    element = torch.empty((), dtype=dtype).element_size()

    process = start_server(str(model_dir), args.port, ["--dtype", args.dtype])
    url = f"http://127.0.0.1:{args.port}"
    try:
        seed = args.seed
        fresh = [make_jpeg(seed + i, 640, 480) for i in range(2 * args.num_requests + 2)]
        prompt = prompt_tokens_of(url, fresh[-1])  # also the warm-up
        measured = {
            "c1_new": asyncio.run(run_level(url, "bench", 1, args.num_requests, args.output_tokens, fresh[:args.num_requests])),
            "c1_repeated": asyncio.run(run_level(url, "bench", 1, args.num_requests, args.output_tokens, fresh[-2:-1])),
            "c8_repeated": asyncio.run(run_level(url, "bench", 8, args.num_requests, args.output_tokens, fresh[-2:-1])),
        }
        before = engine_step_seconds(url)
        measured["c8_new"] = asyncio.run(run_level(url, "bench", 8, args.num_requests, args.output_tokens,
                                                   fresh[args.num_requests:2 * args.num_requests]))
        after = engine_step_seconds(url)
        measured["c8_new"]["engine_s_per_request"] = {
            kind: round((after.get(kind, 0.0) - before.get(kind, 0.0)) / args.num_requests, 4)
            for kind in ("prefill", "decode")}
        # Tower batching (issue 48): how many encoder calls carried c8's fresh images, over how many steps.
        measured["c8_new"]["engine_counts"] = {
            name.removeprefix("vlmd_").removesuffix("_total"): int(after.get(name, 0) - before.get(name, 0))
            for name in ENGINE_COUNTERS}
    finally:
        process.terminate()
        process.wait(30)
    probes.append(probe_host())
    # The best of the probes before and after the load: a probe taken while the host is
    # slowed by a neighbour would put the floor too high (and vlmd "above" it).
    host = {key: max(probe[key] for probe in probes) for key in probes[0]}
    host["probes"] = probes
    host["threads"] = torch.get_num_threads()
    peak = host["gemm_bf16_gflops" if dtype == torch.bfloat16 else "gemm_fp32_gflops"] * 1e9
    flops = prefill_flops(config, prompt)
    mean_context = prompt + args.output_tokens // 2
    decode = {batch: {"bytes_s": decode_bytes(config, batch, mean_context, element) / (host["read_gb_s"] * 1e9),
                      "flops_s": decode_flops(config, batch, mean_context) / peak} for batch in (1, 8)}
    floors = {
        # The arithmetic the prompt needs (the last layer's non-K/V work for its last token
        # only, as vlmd runs it), and every layer over every token (the floor).
        "prefill_ttft_s": flops["needed"] / peak,
        "prefill_ttft_full_model_s": flops["total"] / peak,
        # A step can overlap its reads with its arithmetic at best: the longer one bounds it.
        "decode_c1_s": max(decode[1].values()),
        "decode_c8_s": max(decode[8].values()),
        "c8_new_per_request_s": flops["needed"] / peak + (args.output_tokens - 1) * max(decode[8].values()) / 8,
    }
    figures = {
        "prefill_ttft_s": measured["c1_new"]["ttft_p50_s"],
        "prefill_ttft_full_model_s": measured["c1_new"]["ttft_p50_s"],
        "decode_c1_s": measured["c1_repeated"]["itl_p50_s"],
        "decode_c8_s": measured["c8_repeated"]["itl_p50_s"],
        "c8_new_per_request_s": round(measured["c8_new"]["wall_s"] / args.num_requests, 4),
    }
    print(json.dumps({
        "model": str(model_dir), "dtype": args.dtype, "host": host, "prompt_tokens": prompt,
        "prefill_gflop": {k: round(v / 1e9, 2) for k, v in flops.items()},
        "decode_mb_per_step": {"c1": round(decode_bytes(config, 1, mean_context, element) / 1e6, 1),
                               "c8": round(decode_bytes(config, 8, mean_context, element) / 1e6, 1)},
        "decode_gflop_per_step": {"c1": round(decode_flops(config, 1, mean_context) / 1e9, 3),
                                  "c8": round(decode_flops(config, 8, mean_context) / 1e9, 3)},
        "decode_floor_parts_s": {f"c{batch}": {name: round(value, 4) for name, value in parts.items()}
                                 for batch, parts in decode.items()},
        "workloads": {name: {"floor_s": round(floors[name], 4), "vlmd_s": figures[name],
                             "fraction_of_floor": round(floors[name] / figures[name], 3)} for name in floors},
        "measured": measured,
    }))


if __name__ == "__main__":
    main()
