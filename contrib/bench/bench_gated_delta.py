"""A Gated DeltaNet layer's prefill and decode, whole and in parts (CPU time).

Builds one ``GatedDeltaNet`` (default: a ~100M model's shape, hidden 512, 4 key heads and 8
value heads of 128, conv kernel 4) with random weights over a real KV pool (the layer's
recurrent-state group beside an attention group), then times, each as the least CPU time
(``time.process_time``) of ``--rounds`` runs: a prompt of ``--tokens`` through the layer and
through its parts (the projections, the causal convolution, the chunked rule), and a decode
step of ``--decodes`` sequences (the layer, the recurrent step, the states' read and store).
CPU time, not wall time: on a shared host the least CPU time is the work, wall time is the
neighbours. ``--profile`` prints torch.profiler's table of each whole step. One JSON line:

    python contrib/bench/bench_gated_delta.py [--tokens 512] [--decodes 8] [--threads 1] [--profile]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from vlmd.layers.attention import attention_backend_for
from vlmd.layers.attention.backend import SequenceChunk
from vlmd.layers.linear_attention import gated_delta
from vlmd.layers.linear_attention.gated_delta_net import GatedDeltaNet
from vlmd.layers.linear_attention.state import commit_states, read_states, write_states
from vlmd.runner.kv_cache import allocate_kv_slots, layer_caches
from vlmd.types import KVSpec

from bench_attention import best_ms  # contrib/bench is the script's directory, first on sys.path

BLOCK = 16


def least_cpu_ms(run, rounds: int) -> float:
    return best_ms(run, rounds, clock=time.process_time)


def build(args):
    torch.manual_seed(0)
    layer = GatedDeltaNet(args.hidden, args.key_heads, args.value_heads, args.head_dim, args.head_dim, 4, 1e-6).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(torch.randn(param.shape) * (0.5 if name == "A_log" else 0.05))
    layout = layer.state_layout()
    spec = KVSpec(2, 8, 64, layer_state_bytes=(layout.bytes_per_request, None))
    sequences = max(args.decodes, 1)
    attention_blocks = -(-(args.tokens + 1) // BLOCK)
    config = spec.kv_cache_config(BLOCK, 4, args.tokens + 1, args.tokens, 1)
    group = next(g for g in config.groups if g.kind.name == "recurrent_state")
    per_sequence = attention_blocks + group.blocks_per_request
    config = spec.kv_cache_config(BLOCK, 4, args.tokens + 1, args.tokens, 1 + sequences * per_sequence)
    slots = allocate_kv_slots(spec, config, torch.float32)
    cache = layer_caches(config, slots, range(2), spec)[0]
    backend = attention_backend_for("cpu", BLOCK, "torch")
    tables = []
    for index in range(sequences):
        first = 1 + index * per_sequence
        tables.append({0: list(range(first, first + attention_blocks)),
                       group.index: list(range(first + attention_blocks, first + per_sequence))})
    prefill = backend.prepare_metadata([SequenceChunk.of(tables[0], 0, args.tokens)], 0)
    decode = backend.prepare_metadata([SequenceChunk.of(table, args.tokens, 1) for table in tables], sequences)
    return layer, layout, cache, prefill, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--key-heads", type=int, default=4)
    parser.add_argument("--value-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layer, layout, cache, prefill, decode = build(args)
    prompt = torch.randn(args.tokens, args.hidden)
    rows = torch.randn(args.decodes, args.hidden)

    def step(meta, hidden):
        layer(hidden, meta, cache)
        commit_states(meta)

    weight = layer.conv1d.weight[:, 0]
    qkv = layer.in_proj_qkv(prompt)
    q, k, v = layer._heads(qkv)
    decay, beta = -torch.rand(args.tokens, layer.num_value_heads), torch.rand(args.tokens, layer.num_value_heads)
    results = {"shape": {"hidden": args.hidden, "key_heads": args.key_heads, "value_heads": args.value_heads,
                         "head_dim": args.head_dim, "state_bytes": layout.bytes_per_request},
               "tokens": args.tokens, "decodes": args.decodes, "threads": args.threads,
               "host": platform.processor() or platform.machine()}
    with torch.no_grad():
        step(prefill, prompt)  # the decodes start from a prompt's state
        results["prefill_ms"] = {
            "layer": least_cpu_ms(lambda: step(prefill, prompt), args.rounds),
            "projections": least_cpu_ms(lambda: (layer.in_proj_qkv(prompt), layer.in_proj_z(prompt),
                                                 layer.in_proj_b(prompt), layer.in_proj_a(prompt),
                                                 layer.out_proj(torch.empty(args.tokens, layer.value_dim))),
                                        args.rounds),
            "conv": least_cpu_ms(lambda: gated_delta.causal_conv1d_prefill(qkv, weight, None, None), args.rounds),
            "chunk_rule": least_cpu_ms(lambda: gated_delta.chunk_gated_delta_rule(q, k, v, decay, beta, None),
                                       args.rounds),
        }
        if args.decodes:
            conv, recurrent = read_states(cache, decode, layout)
            dq, dk, dv = layer._heads(layer.in_proj_qkv(rows))
            results["decode_ms"] = {
                "layer": least_cpu_ms(lambda: step(decode, rows), args.rounds * 4),
                "recurrent_step": least_cpu_ms(lambda: gated_delta.recurrent_gated_delta_step(
                    dq, dk, dv, decay[:args.decodes], beta[:args.decodes], recurrent), args.rounds * 4),
                "states_read_and_store": least_cpu_ms(lambda: (read_states(cache, decode, layout),
                                                               write_states(cache, decode, layout, conv, recurrent),
                                                               commit_states(decode)), args.rounds * 4),
            }
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for name, meta, hidden in (("prefill", prefill, prompt), ("decode", decode, rows)):
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    for _ in range(3):
                        step(meta, hidden)
                print(f"== {name}")
                print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
