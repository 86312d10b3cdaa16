"""Decode attention: the CPU paged backend's native kernel vs its torch path (and the old gather).

One decode step of the small LLaVA's decoder shape (12 heads, 4 K/V heads, head_dim 64,
9 layers, block size 16) at context lengths 600, 4k and 16k, batch 1 and 8: metadata once,
then attention in every layer. Block tables as a fresh pool hands them out (ascending
ids), shuffled (every block scattered, the backend's worst case), "interleaved" (each
prompt one run, the last 3 blocks of every decode interleaved with the others', as decode
tails grow) and "shared" (the same, with one prompt's blocks shared by every decode, as
the prefix cache hands out a repeated image). Each scenario is timed through the
backend with the native kernel (``--attention-kernels auto``; skipped where it did not
build) and with torch ops only (``torch``), alternated; ``old`` is the first
implementation's gather, ascending tables only. Prints one JSON line of milliseconds per
step (best of --repeats):

    python contrib/bench/bench_attention.py
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F

from vlmd.layers.attention import SequenceChunk, attention_backend_for, paged_attention


def old_decode_step(q, k, v, caches, block_tables, positions, block_size, scale):
    """The previous implementation's decode path: a padded [B, L] slot index per step,
    then every layer gathers each decode's whole context and runs masked SDPA."""
    context_lens = torch.tensor(positions) + 1
    num_blocks = -(-int(context_lens.max()) // block_size)
    table = torch.tensor([t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in block_tables])
    all_slots = (table.unsqueeze(-1) * block_size + torch.arange(block_size)).view(len(positions), -1)
    max_len = int(context_lens.max())
    slots = all_slots[:, :max_len].contiguous()
    mask = (torch.arange(max_len).unsqueeze(0) < context_lens.unsqueeze(1)).view(len(positions), 1, 1, max_len)
    write = slots.gather(1, torch.tensor(positions).unsqueeze(1)).squeeze(1)
    for k_cache, v_cache in caches:
        k_cache.index_copy_(0, write, k)
        v_cache.index_copy_(0, write, v)
        keys = k_cache[slots].transpose(1, 2)
        values = v_cache[slots].transpose(1, 2)
        F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)


def new_decode_step(q, k, v, caches, block_tables, positions, backend, scale):
    chunks = [SequenceChunk(table, position, 1) for table, position in zip(block_tables, positions)]
    meta = backend.prepare_metadata(chunks, num_decodes=len(chunks))
    for cache in caches:
        paged_attention(q, k, v, cache, meta, scale)


def best_ms(fn, repeats, clock=time.perf_counter):
    """The least of ``repeats`` runs after a warm-up, in ms of ``clock`` (wall time, or
    ``time.process_time`` for CPU time)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = clock()
        fn()
        best = min(best, clock() - started)
    return round(best * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[600, 4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    heads, kv_heads, head_dim, block_size = 12, 4, 64, 16
    scale = head_dim**-0.5
    backends = {"torch": attention_backend_for("cpu", block_size, "torch")}
    native = attention_backend_for("cpu", block_size, "auto")
    if native.native_decode:
        backends["native"] = native
    results = {}
    for batch in args.batches:
        for context in args.contexts:
            per_seq = -(-(context + 1) // block_size)
            num_blocks = per_seq * batch + 1
            caches = [(torch.randn(num_blocks * block_size, kv_heads, head_dim),
                       torch.randn(num_blocks * block_size, kv_heads, head_dim)) for _ in range(args.layers)]
            ids = list(range(num_blocks))
            ascending = [ids[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
            random.Random(0).shuffle(ids)
            shuffled = [ids[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
            # As the server lays them out: a prompt's blocks in one run, then decode tails
            # that grow a block at a time while the other decodes grow too (interleaved);
            # "shared": every decode has the same prompt blocks (prefix cache, one image).
            tail_blocks = min(3, per_seq - 1)
            prompt_blocks = per_seq - tail_blocks
            tails = [[batch * prompt_blocks + j * batch + i for j in range(tail_blocks)] for i in range(batch)]
            interleaved = [list(range(i * prompt_blocks, (i + 1) * prompt_blocks)) + tails[i] for i in range(batch)]
            shared = [list(range(prompt_blocks)) + tails[i] for i in range(batch)]
            positions = [context] * batch
            q = torch.randn(batch, heads, head_dim)
            k, v = torch.randn(batch, kv_heads, head_dim), torch.randn(batch, kv_heads, head_dim)
            scenarios = {"ascending": ascending, "shuffled": shuffled, "interleaved": interleaved, "shared": shared}
            with torch.inference_mode():
                row = {"old_ms": best_ms(lambda: old_decode_step(q, k, v, caches, ascending, positions, block_size,
                                                                 scale), args.repeats)}
                for scenario, tables in scenarios.items():
                    for name, backend in backends.items():
                        row[f"{name}_{scenario}_ms"] = best_ms(
                            lambda: new_decode_step(q, k, v, caches, tables, positions, backend, scale), args.repeats)
                    if "native" in backends:
                        row[f"torch_over_native_{scenario}"] = round(
                            row[f"torch_{scenario}_ms"] / row[f"native_{scenario}_ms"], 2)
            results[f"c{batch}_ctx{context}"] = row
            del caches
    print(json.dumps({"bench": "decode_attention", "layers": args.layers, "threads": torch.get_num_threads(),
                      "ms_per_step": results}))


if __name__ == "__main__":
    main()
