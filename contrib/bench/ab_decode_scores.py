"""bfloat16 decode steps with the AVX512-BF16 decode scores on and off, alternated in one
process (``paged_decode.bf16_dot_scores``): the median step of ``--batch`` decodes of
600-700 tokens each (random prompts, greedy, 100 tokens) through the engine, as the server
runs it (the fused decode step on the CPU), per round. Prints one JSON line.

    python contrib/bench/ab_decode_scores.py --model-dir ~/.cache/vlmd/bench/llava-small-seed0 --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # huge pages, as `vlmd serve` has them (the caches' TLB misses)

from vlmd.config import ServeConfig  # noqa: E402
from vlmd.engine.builder import build_engine  # noqa: E402
from vlmd.layers.cpu import paged_decode  # noqa: E402
from vlmd.types import EngineRequest, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if not paged_decode.bf16_dot_scores(True):
        raise SystemExit("this host (or the loaded kernel variant) has no AVX512-BF16 decode scores to compare")
    built = build_engine(ServeConfig(model=args.model_dir, dtype="bfloat16"))
    core = built.core

    def median_step(dot: bool, seed: int) -> float:
        paged_decode.bf16_dot_scores(dot)
        rng = random.Random(seed)
        for i in range(args.batch):
            prompt = [rng.randrange(3, built.tokenizer.vocab_size - 1) for _ in range(600)]
            core.add_request(EngineRequest(f"{seed}-{i}", prompt, SamplingParams(max_tokens=100, temperature=0,
                                                                              ignore_eos=True),
                                           eos_token_ids=built.eos_token_ids))
        steps, started = [], set()
        while core.has_work():
            begun = time.perf_counter()
            deltas, _ = core.step()
            elapsed = time.perf_counter() - begun
            if len(started) == args.batch:  # every prompt prefilled: a decode step of the whole batch
                steps.append(elapsed)
            started |= {d.request_id for d in deltas if d.new_token_ids}
        return statistics.median(steps) * 1e3

    times = {True: [], False: []}
    for seed in range(args.rounds):
        for dot in ((True, False) if seed % 2 else (False, True)):
            times[dot].append(round(median_step(dot, seed), 2))
    print(json.dumps({"bench": "ab_decode_scores", "model": args.model_dir, "batch": args.batch,
                      "cpu": platform.processor() or platform.machine(),
                      "dot_ms": times[True], "widening_ms": times[False],
                      "median_dot_ms": statistics.median(times[True]),
                      "median_widening_ms": statistics.median(times[False])}))


if __name__ == "__main__":
    main()
