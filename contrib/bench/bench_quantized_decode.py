"""Decode at c1 with float32, bfloat16 and weight-only int8 weights (issue 35 item 2), on
the small LLaVA checkpoint: each loaded as ``vlmd serve`` loads it (``--dtype``,
``--quantization``; kernels timed at start-up), the three stepped alternately in one
process over the same text prompt (a loaded host then slows all of them, not one), and
printed as one JSON line: the median time per decode step (its forward and the LM head's
logits), the weight bytes a step reads (every decoder product and the LM head as its format
stores it: ``--quantization int8`` quantizes both), and the bytes floor: those bytes over
the host's read bandwidth measured as ``roofline.py`` measures it.

    python contrib/bench/bench_quantized_decode.py [--model-dir DIR] [--steps 32] [--rounds 3] [--linear-kernels auto]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as `vlmd serve` sets it

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import read_bandwidth  # noqa: E402

FORMATS = {"float32": (torch.float32, "none"), "bfloat16": (torch.bfloat16, "none"), "int8": (torch.float32, "int8")}


def step_bytes(model) -> int:
    """Weight bytes one decode step reads: each decoder product and the LM head as stored
    (int8 panels and their scales, else the weight in the model's dtype). A tied head's
    float weight is the embeddings' (which a step reads one row of), so an int8 head counts
    its panels alone whether tied or not."""
    from vlmd.testing.greedy_steps import language_model

    lm = language_model(model)
    element = lm.embed_tokens.weight.element_size()  # the model's dtype (a packed layer drops its weight)
    total = 0
    for layer in [*lm.decoder_structure.products(), lm.lm_head]:
        stored = [b for name, b in layer.named_buffers() if name in ("weight_int8", "weight_scales")]
        total += (sum(b.numel() * b.element_size() for b in stored) if stored
                  else layer.input_size * layer.output_size * element)
    return total


def main() -> None:
    from vlmd.config import cache_dir
    from vlmd.engine.builder import load_model
    from vlmd.testing.greedy_steps import greedy_steps
    from vlmd.testing.tiny import build_tiny

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=str(cache_dir() / "bench" / "llava-small-seed0"))
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    # native: every format's decode products on vlmd's kernels, so each step is the fused
    # native step and the formats differ in the bytes they read alone; auto: as `vlmd
    # serve` picks them (timed at load, so a loaded host can pick differently per format).
    parser.add_argument("--linear-kernels", default="native", choices=("native", "auto"))
    args = parser.parse_args()
    model_dir = Path(args.model_dir).expanduser()
    if not (model_dir / "config.json").exists():
        build_tiny("llava", model_dir, seed=0, size="small")
    models = {name: load_model(str(model_dir), dtype, linear_kernels=args.linear_kernels, quantization=quantization)
              for name, (dtype, quantization) in FORMATS.items()}
    rng = random.Random(0)
    prompt = [rng.randrange(3, 1000) for _ in range(args.prompt_tokens)]
    bandwidth = read_bandwidth()
    steps: dict[str, list[float]] = {name: [] for name in models}
    paths: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, model in models.items():
            run = greedy_steps(model, prompt, args.steps)
            steps[name] += run.step_seconds[1:]  # the first decode step allocates
            paths[name] = run.decode_paths
    bandwidth = max(bandwidth, read_bandwidth())  # the better probe: a slowed one lowers the floor
    result = {"bench": "quantized_decode", "model": str(model_dir), "linear_kernels": args.linear_kernels,
              "threads": torch.get_num_threads(),
              "read_gb_s": round(bandwidth / 1e9, 1), "step_ms": {}, "weight_bytes_per_step": {},
              "bytes_floor_ms": {}, "floor_over_measured": {}, "decode_paths": paths}
    for name, model in models.items():
        median = statistics.median(steps[name])
        weight = step_bytes(model)
        result["step_ms"][name] = round(median * 1e3, 2)
        result["weight_bytes_per_step"][name] = weight
        result["bytes_floor_ms"][name] = round(weight / bandwidth * 1e3, 2)
        result["floor_over_measured"][name] = round(weight / bandwidth / median, 2)
    result["int8_over_float32"] = round(result["step_ms"]["int8"] / result["step_ms"]["float32"], 2)
    result["bfloat16_over_float32"] = round(result["step_ms"]["bfloat16"] / result["step_ms"]["float32"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
