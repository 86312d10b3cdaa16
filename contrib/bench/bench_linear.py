"""A decode step's linear products: oneDNN's packed kernel vs vlmd's native kernel.

Builds the products of one decode step of a Llama-shaped decoder (default: the small
LLaVA's, 768 hidden, 2048 intermediate, 9 layers, 12 / 4 heads, 8192 vocabulary: 37
products, 251 MB of float32 weights), packs them as the server does, and times all of
them in model order at each M (rows: the step's decodes), alternating oneDNN (as packed,
no padding), oneDNN with the rows padded to 6 (M < 6), and vlmd's kernel on the same
packed weights. Inputs are pre-allocated, so a pass is the products alone. Prints one JSON
line: per M, the median ms of a pass and the weights' streaming rate in GB/s:

    python contrib/bench/bench_linear.py [--rows 1,2,4,8,16,32,64] [--rounds 21] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

# Huge pages, as `vlmd serve` sets them (cli.py): the weights' TLB misses are part of
# what a product costs, so the bench must pay the server's, not fewer or more.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

from vlmd.layers.linear.kernels import M_BUCKETS, NATIVE, PACKED  # noqa: E402
from vlmd.layers.linear.layers import ReplicatedLinear  # noqa: E402
from vlmd.layers.linear.selection import _DECISIONS, select_linear_kernels  # noqa: E402


def decoder_products(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
                     dtype: torch.dtype = torch.float32):
    head_dim = hidden // heads
    shapes = []
    for _ in range(layers):
        shapes += [(hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden),
                   (hidden, 2 * intermediate), (intermediate, hidden)]
    shapes.append((hidden, vocab))
    generator = torch.Generator().manual_seed(0)
    modules = []
    for in_features, out_features in shapes:
        layer = ReplicatedLinear(in_features, out_features, bias=False)
        layer.weight.data.normal_(generator=generator)
        modules.append(layer.to(dtype))
    return torch.nn.Sequential(*modules)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = decoder_products(args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.vocab, dtype)
    layers = list(model)
    weight_bytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    _DECISIONS.clear()
    with torch.inference_mode():
        select_linear_kernels(model, "native")
        native = all(layer.kernel.panels is not None for layer in layers)
        variants = {"onednn": (PACKED, 0), "onednn+pad6": (PACKED, 6)}
        if native:
            variants["native"] = (NATIVE, 0)
        result = {"bench": "linear", "dtype": args.dtype, "weights_MB": round(weight_bytes / 1e6, 1), "threads": torch.get_num_threads(),
                  "cpu": platform.processor() or platform.machine(), "native_available": native, "rows": {}}
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = [torch.randn(rows, layer.kernel.panels.in_features if native else layer.input_size).to(dtype)
                      for layer in layers]
            tried = {name: v for name, v in variants.items() if not (name == "onednn+pad6" and rows >= 6)}
            times = {name: [] for name in tried}
            for round_index in range(args.rounds + 1):
                for name, (choice, pad) in tried.items():
                    for layer in layers:
                        layer.kernel.choices = (choice,) * (len(M_BUCKETS) - 1) + (PACKED,)
                        layer.kernel.pad_rows = pad
                    started = time.perf_counter()
                    for layer, x in zip(layers, inputs):
                        layer.kernel(x, None)
                    if round_index:  # the first round warms up
                        times[name].append(time.perf_counter() - started)
            result["rows"][rows] = {name: {"ms": round(statistics.median(t) * 1e3, 3),
                                           "GB/s": round(weight_bytes / statistics.median(t) / 1e9, 1)}
                                    for name, t in times.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
