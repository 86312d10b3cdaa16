"""bfloat16 attention: flash_bf16.c (AVX512-BF16 dot products) against torch's bfloat16 flash
kernel and paged_prefill.c (which widens bfloat16 to float32), one chunk from position 0.

Shapes: the small LLaVA's causal prefills (12 heads over 4 of 64) at 587, 1,750 and 4,096
tokens, a CLIP image (8 heads of 64 over 577 tokens, not causal), 1,024 tokens of 128-wide
heads (12 over 2) and a 1,024-patch image in Qwen2-VL's tower (16 heads of 80, not causal).
Prints one JSON line: per shape, the median ms of each and GFLOP/s of useful work (the
causal mask's half counted once):

    python contrib/bench/bench_flash_bf16.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from vlmd.layers.cpu import flash_bf16, paged_prefill

SHAPES = ((587, 12, 4, 64, True), (1750, 12, 4, 64, True), (4096, 12, 4, 64, True), (577, 8, 8, 64, False),
          (1024, 12, 2, 128, True), (1024, 16, 16, 80, False))


def median_ms(call, rounds: int) -> float:
    for _ in range(2):
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(sorted(times)[len(times) // 2] * 1e3, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if not flash_bf16.serves(64):
        raise SystemExit("this host (or kernel library) has no AVX512-BF16 attention")
    torch.manual_seed(0)
    torch_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    result = {"bench": "flash_bf16", "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "shapes": {}}
    for tokens, heads, kv_heads, dim, causal in SHAPES:
        block_size = 16 if causal else tokens
        table = torch.arange(-(-tokens // block_size), dtype=torch.int32)
        k_cache = torch.randn(len(table) * block_size, kv_heads, dim).bfloat16()
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(tokens, heads, dim).bfloat16()
        out = torch.empty_like(q)
        scale = dim ** -0.5
        group = heads // kv_heads
        q_heads = q.transpose(0, 1).unsqueeze(0)
        k_heads = k_cache[:tokens].repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
        v_heads = v_cache[:tokens].repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
        timings = {
            "flash_bf16": median_ms(lambda: flash_bf16.flash_bf16(q, k_cache, v_cache, table, block_size, 0, scale, out,
                                                                  causal), args.rounds),
            "torch_flash": median_ms(lambda: torch_flash(q_heads, k_heads, v_heads, 0.0, causal, scale=scale), args.rounds),
        }
        if paged_prefill.supports(k_cache, q):
            timings["paged_prefill"] = median_ms(
                lambda: paged_prefill.paged_prefill(q, k_cache, v_cache, table, block_size, 0, scale, out, causal),
                args.rounds)
        flops = 4 * tokens * tokens * heads * dim * (0.5 if causal else 1.0)
        name = f"{tokens}x{heads}/{kv_heads}x{dim}{' causal' if causal else ''}"
        result["shapes"][name] = {kernel: {"ms": ms, "GFLOP/s": round(flops / ms / 1e6)} for kernel, ms in timings.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
