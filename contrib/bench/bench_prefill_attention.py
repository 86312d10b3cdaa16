"""Prefill attention: the CPU paged backend's native kernel vs its torch path, by chunk and context.

One prefill chunk of ``n`` new tokens after ``start`` cached ones (its keys: ``start + n``),
through the backend with the native prefill kernel forced for every chunk and with torch
ops only, alternated; the backend's own choice (``NATIVE_PREFILL_MAX_KEYS``) is what the
ratios justify. Block size 16, a contiguous table (the engine hands a prompt's blocks out
in one run). Prints one JSON line of milliseconds (best of ``--repeats``) and the ratio
native / torch per point:

    python contrib/bench/bench_prefill_attention.py
    python contrib/bench/bench_prefill_attention.py --heads 16 --kv-heads 4 --head-dim 128
    python contrib/bench/bench_prefill_attention.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json

import torch

from vlmd.layers.attention import SequenceChunk, attention_backend_for
from vlmd.layers.attention import cpu_paged

from bench_attention import best_ms  # contrib/bench is the script's directory, first on sys.path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256, 600, 1024, 2048])
    parser.add_argument("--starts", type=int, nargs="+", default=[0, 256, 512, 1024, 2048, 8192])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the caches', queries' and keys' dtype (a bfloat16 cache is read in place)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    block_size = 16
    torch.manual_seed(0)
    total = max(args.starts) + max(args.new_tokens)
    num_blocks = -(-total // block_size)
    k_cache = torch.randn(num_blocks * block_size, args.kv_heads, args.head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = list(range(num_blocks))
    scale = args.head_dim**-0.5
    native = attention_backend_for("cpu", block_size, "auto")
    if not native.native_prefill:
        raise SystemExit("the native prefill kernel did not build here")
    backends = {"native": native, "torch": attention_backend_for("cpu", block_size, "torch")}
    bound = cpu_paged.NATIVE_PREFILL_MAX_KEYS
    points = {}
    try:
        cpu_paged.NATIVE_PREFILL_MAX_KEYS = 1 << 62  # the native backend takes every chunk here
        for n in args.new_tokens:
            for start in args.starts:
                q = torch.randn(n, args.heads, args.head_dim, dtype=dtype)
                k = torch.randn(n, args.kv_heads, args.head_dim, dtype=dtype)
                v = torch.randn(n, args.kv_heads, args.head_dim, dtype=dtype)
                row = {}
                with torch.inference_mode():
                    for name, backend in backends.items():
                        meta = backend.prepare_metadata([SequenceChunk(table, start, n)], num_decodes=0)
                        row[f"{name}_ms"] = best_ms(lambda: backend.forward(q, k, v, (k_cache, v_cache), meta, scale),
                                                    args.repeats)
                row["native_over_torch"] = round(row["native_ms"] / row["torch_ms"], 2)
                points[f"n{n}_start{start}_keys{start + n}"] = row
    finally:
        cpu_paged.NATIVE_PREFILL_MAX_KEYS = bound
    print(json.dumps({"bench": "prefill_attention", "dtype": args.dtype, "heads": args.heads, "kv_heads": args.kv_heads,
                      "head_dim": args.head_dim, "threads": torch.get_num_threads(),
                      "native_prefill_max_keys": bound, "points": points}))


if __name__ == "__main__":
    main()
