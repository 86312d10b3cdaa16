"""Two builds of ``paged_decode.c`` alternated in one process: microseconds per layer of
the small LLaVA's decode attention (12 heads over 4 KV heads of 64, block size 16, 9
layers' caches of their own, block tables scattered), hot (the caches as the last round
left them) and cold (64 MiB written between rounds), medians of --rounds, and the largest
difference between the two builds' outputs. Each build is a git revision's kernel sources
(``vlmd/layers/cpu`` as committed there, headers included, so a change of the kernel's
signature builds too) or ``tree`` (the working tree):

    python contrib/bench/ab_paged_decode.py HEAD~1 tree

Cases: c1 (one decode of 620 tokens), c8u (8 unshared decodes of 620), c8s / c16s (8 / 16
decodes sharing 608 tokens, each with 12-40 of its own). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # huge pages, as `vlmd serve` has them

import torch  # noqa: E402

from vlmd.layers.cpu.library import Signature  # noqa: E402
from vlmd.layers.cpu.paged_decode import DecodeTables  # noqa: E402
from vlmd.layers.cpu.variants import COMMON_FLAGS, LINK_FLAGS  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK, LAYERS, BLOCKS = 12, 4, 64, 16, 9, 4096


KERNELS = Path("vlmd/layers/cpu")
REPO = Path(__file__).resolve().parents[2]


def sources(revision: str, directory: str) -> Path:
    """The kernel sources of ``revision`` (``tree``: the working tree) in a directory."""
    if revision == "tree":
        return REPO / KERNELS
    if Path(revision).is_dir():  # a directory holding kernel sources (a variant being tried)
        return Path(revision)
    target = Path(directory) / f"src-{len(list(Path(directory).iterdir()))}"
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, str(KERNELS)], check=True,
                             capture_output=True).stdout
    target.mkdir()
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target / KERNELS


def build(revision: str, directory: str, tag: str):
    """``paged_decode.c`` of ``revision`` with its signature table, for this host (the
    package's variants are built at install; an A/B of two sources needs its own builds)."""
    target = Path(directory) / f"paged_decode_{tag}.so"
    include = sources(revision, directory)
    subprocess.run([os.environ.get("CC", "cc"), *COMMON_FLAGS, "-march=native", "-fPIC", "-shared", "-I",
                    str(include), str(include / "paged_decode.c"), str(include / "signatures.c"), "-o", str(target),
                    *LINK_FLAGS, "-lm"], check=True)
    library = ctypes.CDLL(str(target))
    table = ctypes.cast(library.vlmd_kernel_signatures, ctypes.c_char_p).value.decode().splitlines()
    signature = next(Signature.parse(line) for line in table if " vlmd_paged_decode(" in line)
    function = library.vlmd_paged_decode
    function.argtypes, function.restype = signature.argtypes, signature.restype
    return function


def tables(case: str, rng: random.Random) -> DecodeTables:
    pool = list(range(1, BLOCKS))
    rng.shuffle(pool)
    take = lambda n: [pool.pop() for _ in range(n)]  # noqa: E731
    if case in ("c8s", "c16s"):
        batch, shared = (8 if case == "c8s" else 16), take(608 // BLOCK)
        lengths = [608 + rng.randint(12, 40) for _ in range(batch)]
        return DecodeTables.of([shared + take(-(-(n - 608) // BLOCK)) for n in lengths], lengths, BLOCK,
                               [(list(range(batch)), 608 // BLOCK)])
    batch = {"c1": 1, "c8u": 8}[case]
    return DecodeTables.of([take(-(-620 // BLOCK)) for _ in range(batch)], [620] * batch, BLOCK)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("old", help="a git revision, tree, or a directory of kernel sources")
    parser.add_argument("new", help="a git revision, tree, or a directory of kernel sources")
    parser.add_argument("--cases", nargs="+", default=["c1", "c8u", "c8s", "c16s"])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the caches' dtype (a bfloat16 model's caches are bfloat16)")
    args = parser.parse_args()
    cache_dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as directory:
        builds = {"old": build(args.old, directory, "old"), "new": build(args.new, directory, "new")}
        caches = [(torch.randn(BLOCKS * BLOCK, KV_HEADS, DIM).to(cache_dtype),
                   torch.randn(BLOCKS * BLOCK, KV_HEADS, DIM).to(cache_dtype)) for _ in range(LAYERS)]
        junk = torch.empty(16 << 20)
        rng, result = random.Random(1), {}

        def call(function, q, t, layer, out):
            k, v = caches[layer]
            arguments = [q.data_ptr(), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16),
                         t.block_tables.data_ptr(),
                         t.context_lens.data_ptr(), out.data_ptr(), q.shape[0], HEADS, KV_HEADS, DIM, BLOCK,
                         t.block_tables.shape[1], k.shape[0], t.group_tokens.shape[0], t.group_offsets.data_ptr(),
                         t.group_members.data_ptr(), t.group_tokens.data_ptr(), DIM ** -0.5,
                         torch.get_num_threads(), 0]
            # Builds from before the window argument (D94) take one fewer: no window is 0.
            code = function(*arguments, *[0] * (len(function.argtypes) - len(arguments)))
            if code:
                raise RuntimeError(f"paged decode returned {code}")

        for case in args.cases:
            t = tables(case, rng)
            q = torch.randn(t.context_lens.shape[0], HEADS, DIM)
            outs = {name: torch.empty_like(q) for name in builds}
            for name, function in builds.items():
                call(function, q, t, 0, outs[name])
            figures = {"max_difference": float((outs["old"] - outs["new"]).abs().max())}
            for mode in ("hot", "cold"):
                times = {name: [] for name in builds}
                for round_index in range(args.rounds):
                    order = list(builds) if round_index % 2 else list(reversed(list(builds)))
                    for name in order:
                        if mode == "cold":
                            junk.add_(1)
                        started = time.perf_counter()
                        for layer in range(LAYERS):
                            call(builds[name], q, t, layer, outs[name])
                        times[name].append((time.perf_counter() - started) / LAYERS * 1e6)
                figures[mode] = {name: round(statistics.median(values), 1) for name, values in times.items()}
            result[case] = figures
    print(json.dumps({"bench": "ab_paged_decode", "dtype": args.dtype, "us_per_layer": result, "rounds": args.rounds,
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
