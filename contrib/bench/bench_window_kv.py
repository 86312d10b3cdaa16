"""KV bytes held at a long context with and without Gemma 3's sliding-window KV groups.

Prints one JSON line. Two parts:

- ``gemma3_4b``: the published Gemma 3 4B text config (34 layers, 5 of them full attention,
  29 with a 1,024-token window; 4 KV heads of 256, bfloat16), through the accounting alone:
  the KV manager (vlmd/sched/kv_manager.py) drives one request of ``--context`` tokens in
  chunks of the default token budget, and the bytes it holds afterwards are compared with
  one table for every layer (what vlmd held before docs/decisions.md D91) and with
  `vlmd cost`'s figure for the same request (vlmd/cost.py: they must agree).
- ``tiny``: a real run on the tiny checkpoint (24-token window on every other layer): one
  text request of ``--tiny-context`` prompt tokens through the engine; the blocks each group
  held at the end of the prefill and the most the window group held, in bytes of the
  runner's own KV tensors.

    python contrib/bench/bench_window_kv.py [--context 8192] [--tiny-dir DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# google/gemma-3-4b-it's text_config (config.json), the fields the KV cache depends on.
GEMMA3_4B_TEXT = dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                      sliding_window_pattern=6, max_position_embeddings=131072, vocab_size=262208)


def accounting(context: int, block_size: int, budget: int, max_num_seqs: int, dtype_bytes: int) -> dict:
    from transformers import Gemma3TextConfig

    from vlmd.engine.memory_plan import kv_group_sizes
    from vlmd.sched.kv_groups import WindowGroup, window_blocks_held
    from vlmd.sched.kv_manager import KVCacheManager, blocks_needed
    from vlmd.sched.request import Request
    from vlmd.types import EngineRequest, KVSpec, SamplingParams
    from vlmd_gemma3.layer_kinds import layer_windows

    config = Gemma3TextConfig(**GEMMA3_4B_TEXT)
    spec = KVSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, layer_windows(config))
    main_bytes, windows = kv_group_sizes(spec, dtype_bytes, block_size, max_num_seqs, budget, context + 1)
    (group,) = windows
    kv = KVCacheManager(blocks_needed(context, block_size), block_size, enable_prefix_caching=False,
                        window_groups=[WindowGroup(group.window, group.worst_blocks)])
    request = Request(EngineRequest("long", list(range(context)), SamplingParams(max_tokens=1)))
    while request.num_computed_tokens < context:
        end = min(context, request.num_computed_tokens + budget)
        kv.allocate_slots(request, end)
        request.num_computed_tokens = end
    kv.release_out_of_window("long", context)  # what the next step does first
    main_held = len(kv.block_ids("long"))
    window_held = kv.window_stats()[0]["used_blocks"]
    held = main_held * main_bytes + window_held * group.bytes_per_block
    cost_figure = main_held * main_bytes + window_blocks_held(context, group.window, block_size) * group.bytes_per_block
    if cost_figure != held:
        raise SystemExit(f"vlmd cost's figure {cost_figure} differs from the KV manager's {held}")
    without = blocks_needed(context, block_size) * spec.bytes_per_token(dtype_bytes) * block_size
    return {"layers": spec.num_layers, "full_layers": spec.layers_with(None), "window": group.window,
            "window_layers": spec.layers_with(group.window), "main_blocks": main_held, "window_blocks": window_held,
            "window_peak_request_blocks": kv.window_stats()[0]["peak_request_blocks"],
            "kv_bytes_with_window": held, "kv_bytes_without_window": without,
            "ratio": round(without / held, 2), "window_pool_blocks": group.worst_blocks,
            "window_pool_bytes": group.worst_blocks * group.bytes_per_block}


def tiny_run(model_dir: str, prompt_tokens: int, budget: int) -> dict:
    from vlmd.config import ServeConfig
    from vlmd.engine.builder import build_engine
    from vlmd.types import EngineRequest, SamplingParams

    built = build_engine(ServeConfig(model=model_dir, max_model_len=prompt_tokens + 64, max_num_batched_tokens=budget,
                                     max_num_seqs=4, num_kv_blocks=-(-(prompt_tokens + 64) // 16) + 8))
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
            at_prompt_end = (len(kv.block_ids("long")), kv.window_stats()[0]["used_blocks"])
    spec = runner.model.kv_spec
    (window,) = spec.windows()
    # A block in each group's layers, from the runner's own KV tensors (K and V, 16 rows each).
    per_block = {None: 0, window: 0}
    for layer, (k_cache, _) in enumerate(runner.kv_caches):
        per_block[spec.window_of(layer)] += 2 * 16 * k_cache[0].numel() * k_cache.element_size()
    main_blocks, window_blocks = at_prompt_end
    return {"prompt_tokens": prompt_tokens, "window": window, "main_blocks": main_blocks,
            "window_blocks": window_blocks, "window_peak_request_blocks": kv.window_stats()[0]["peak_request_blocks"],
            "kv_bytes_held_with_window": main_blocks * per_block[None] + window_blocks * per_block[window],
            "kv_bytes_held_without_window": main_blocks * (per_block[None] + per_block[window]),
            "kv_tensor_bytes": sum(2 * k.numel() * k.element_size() for k, _ in runner.kv_caches),
            "window_pool_blocks": runner.window_blocks[window]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tiny-dir", default=None, help="the tiny Gemma 3 checkpoint (built when missing)")
    parser.add_argument("--tiny-context", type=int, default=4000, help="its max_position_embeddings is 4096")
    args = parser.parse_args()
    from vlmd.logs import configure_logging

    configure_logging("warning")  # the JSON line alone on stdout
    line = {"bench": "window_kv", "context": args.context, "block_size": args.block_size, "budget": args.budget,
            "gemma3_4b_bf16": accounting(args.context, args.block_size, args.budget, args.max_num_seqs, 2)}
    tiny_dir = Path(args.tiny_dir or Path.home() / ".cache/vlmd/bench/gemma3-tiny-seed0").expanduser()
    if not (tiny_dir / "config.json").exists():
        from vlmd.tiny import build_tiny

        build_tiny("gemma3", tiny_dir, seed=0, size="tiny")
    line["tiny_float32"] = tiny_run(str(tiny_dir), args.tiny_context, 256)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
