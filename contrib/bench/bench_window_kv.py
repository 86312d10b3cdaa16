"""KV bytes held at a long context, and requests held at once, with and without Gemma 3's
sliding-window KV groups (the KV model: vlmd/sched/kv_spec.py, docs/decisions.md D95).

Prints one JSON line. Two parts:

- ``gemma3_4b_bf16``: the published Gemma 3 4B text config (34 layers, 5 of them full
  attention, 29 with a 1,024-token window; 4 KV heads of 256, bfloat16), through the
  accounting alone: the KV coordinator (vlmd/sched/kv_manager.py) drives one request of
  ``--context`` tokens in chunks of the default token budget; the bytes it holds afterwards
  are compared with the same layers all full attention and with `vlmd cost`'s figure for the
  same request (they must agree), and the requests of that length a ``--kv-cache-gb`` pool
  holds at once, windowed against all full (the maximum concurrency the server logs).
- ``tiny_float32``: a real run on the tiny checkpoint (24-token window on every other layer):
  one text request of ``--tiny-context`` prompt tokens through the engine; the blocks each
  group held at the end of the prefill and the most the window group held, in bytes of the
  runner's own pool tensors.

    python contrib/bench/bench_window_kv.py [--context 8192] [--kv-cache-gb 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# google/gemma-3-4b-it's text_config (config.json), the fields the KV cache depends on.
GEMMA3_4B_TEXT = dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                      sliding_window_pattern=6, max_position_embeddings=131072, vocab_size=262208)


def accounting(context: int, block_size: int, budget: int, dtype_bytes: int, kv_cache_gb: float) -> dict:
    from transformers import Gemma3TextConfig

    from vlmd.sched.block_pool import blocks_needed
    from vlmd.sched.kv_manager import KVCacheManager
    from vlmd.sched.request import Request
    from vlmd.types import EngineRequest, KVSpec, SamplingParams
    from vlmd_gemma3.layer_kinds import layer_windows

    config = Gemma3TextConfig(**GEMMA3_4B_TEXT)
    spec = KVSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, layer_windows(config))
    full = KVSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    kv_config = spec.kv_cache_config(block_size, dtype_bytes, context + 1, budget)
    kv = KVCacheManager(kv_config.with_blocks(sum(kv_config.peak_request_blocks(context, budget))),
                        enable_prefix_caching=False)
    request = Request(EngineRequest("long", list(range(context)), SamplingParams(max_tokens=1)))
    while request.num_computed_tokens < context:
        end = min(context, request.num_computed_tokens + budget)
        kv.allocate_slots(request, end)
        request.num_computed_tokens = end
    kv.release_out_of_window("long", context)  # what the next step does first
    stats = kv.group_stats()
    held = sum(group["used_blocks"] for group in stats) * kv_config.page_bytes
    cost_figure = sum(kv_config.request_blocks(context)) * kv_config.page_bytes
    if cost_figure != held:
        raise SystemExit(f"vlmd cost's figure {cost_figure} differs from the KV manager's {held}")
    full_config = full.kv_cache_config(block_size, dtype_bytes, context + 1, budget)
    without = blocks_needed(context, block_size) * full_config.page_bytes
    pool = int(kv_cache_gb * 2**30)
    windowed_held = kv_config.with_blocks(pool // kv_config.page_bytes).max_concurrency(context)
    full_held = full_config.with_blocks(pool // full_config.page_bytes).max_concurrency(context)
    return {"layers": spec.num_layers, "full_layers": spec.layer_windows.count(None), "window": config.sliding_window,
            "groups": len(kv_config.groups), "layer_slots": kv_config.num_slots,
            "blocks_per_group": [group["used_blocks"] for group in stats],
            "window_peak_request_blocks": max(group["peak_request_blocks"] for group in stats[1:]),
            "kv_bytes_with_window": held, "kv_bytes_without_window": without, "ratio": round(without / held, 2),
            "kv_cache_gb": kv_cache_gb, "requests_held_with_window": round(windowed_held, 2),
            "requests_held_without_window": round(full_held, 2),
            "concurrency_ratio": round(windowed_held / full_held, 2)}


def tiny_run(model_dir: str, prompt_tokens: int, budget: int) -> dict:
    from vlmd.config import ServeConfig
    from vlmd.engine.builder import build_engine
    from vlmd.types import EngineRequest, SamplingParams

    built = build_engine(ServeConfig(model=model_dir, max_model_len=prompt_tokens + 64, max_num_batched_tokens=budget,
                                     max_num_seqs=4, num_kv_blocks=-(-(prompt_tokens + 64) // 16) + 24))
    core = built.core
    kv, runner = core.scheduler.kv, core.executor.runner
    prompt = [3 + (i * 7919) % (built.tokenizer.vocab_size - 4) for i in range(prompt_tokens)]
    core.add_request(EngineRequest("long", prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                                   eos_token_ids=built.eos_token_ids))
    at_prompt_end = None
    while core.has_work():
        core.step()
        request = core.scheduler.requests.get("long")
        if at_prompt_end is None and request is not None and request.num_computed_tokens >= prompt_tokens:
            kv.release_out_of_window("long", request.num_computed_tokens)
            at_prompt_end = [group["used_blocks"] for group in kv.group_stats()]
    page = runner.kv_config.page_bytes
    return {"prompt_tokens": prompt_tokens, "groups": [group["kind"] for group in kv.group_stats()],
            "blocks_per_group": at_prompt_end,
            "window_peak_request_blocks": kv.group_stats()[1]["peak_request_blocks"],
            "kv_bytes_held_with_window": sum(at_prompt_end) * page,
            "kv_bytes_held_without_window": at_prompt_end[0] * len(at_prompt_end) * page,
            "pool_tensor_bytes": sum(2 * k.numel() * k.element_size() for k, _ in runner.kv_slots)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    parser.add_argument("--kv-cache-gb", type=float, default=8.0, help="the pool whose concurrency is compared")
    parser.add_argument("--tiny-dir", default=None, help="the tiny Gemma 3 checkpoint (built when missing)")
    parser.add_argument("--tiny-context", type=int, default=4000, help="its max_position_embeddings is 4096")
    args = parser.parse_args()
    from vlmd.logs import configure_logging

    configure_logging("warning")  # the JSON line alone on stdout
    line = {"bench": "window_kv", "context": args.context, "block_size": args.block_size, "budget": args.budget,
            "gemma3_4b_bf16": accounting(args.context, args.block_size, args.budget, 2, args.kv_cache_gb)}
    tiny_dir = Path(args.tiny_dir or Path.home() / ".cache/vlmd/bench/gemma3-tiny-seed0").expanduser()
    if not (tiny_dir / "config.json").exists():
        from vlmd.tiny import build_tiny

        build_tiny("gemma3", tiny_dir, seed=0, size="tiny")
    line["tiny_float32"] = tiny_run(str(tiny_dir), args.tiny_context, 256)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
