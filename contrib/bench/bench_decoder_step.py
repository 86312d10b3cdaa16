"""Decode steps with the native decoder step (``layers/cpu/decoder_step.c``) on and off,
alternated in one process over the same requests: step medians and whether the greedy
tokens agree. Text prompts of --prompt-tokens random ids, --batch requests at a time,
--output-tokens each; prints one JSON line:

    python contrib/bench/bench_decoder_step.py --model-dir ~/.cache/vlmd/bench/llava-small-seed0

(a Gemma 3 checkpoint too: ``vlmd_gemma3.tiny.build_tiny_gemma3(out, size="small")``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as `vlmd serve` sets it


def main() -> None:
    from vlmd.config import cache_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=str(cache_dir() / "bench" / "llava-small-seed0"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=610)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="the engine's torch threads (default: vlmd's)")
    args = parser.parse_args()

    from vlmd.config import ServeConfig
    from vlmd.engine.builder import build_engine
    from vlmd.layers.cpu.fused_step import FusedDecodeSteps
    from vlmd.types import EngineRequest, SamplingParams

    built = build_engine(ServeConfig(model=str(Path(args.model_dir).expanduser()), dtype=args.dtype,
                                     torch_threads=args.threads))
    core, native_step = built.core, FusedDecodeSteps.run
    vocab = built.tokenizer.vocab_size

    def run(native: bool, seed: int) -> tuple[dict, float]:
        FusedDecodeSteps.run = native_step if native else (lambda *a, **k: None)
        rng = random.Random(seed)
        tokens: dict[str, list[int]] = {}
        for i in range(args.batch):
            prompt = [rng.randrange(3, vocab - 1) for _ in range(args.prompt_tokens)]
            sampling = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
            core.add_request(EngineRequest(f"{native}-{seed}-{i}", prompt, sampling, eos_token_ids=built.eos_token_ids))
        decode_steps = []
        while core.has_work():
            started = time.perf_counter()
            deltas, _ = core.step()
            elapsed = time.perf_counter() - started
            if all(tokens.get(d.request_id) for d in deltas) and deltas:  # every request past its prefill
                decode_steps.append(elapsed)
            for delta in deltas:
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids or [])
        return {k.split("-", 1)[1]: v for k, v in tokens.items()}, statistics.median(decode_steps) * 1e3

    module_ms, native_ms, equal = [], [], True
    for seed in range(args.rounds):
        first, second = (False, True) if seed % 2 == 0 else (True, False)
        results = {first: run(first, seed), second: run(second, seed)}
        equal &= results[True][0] == results[False][0]
        module_ms.append(round(results[False][1], 2))
        native_ms.append(round(results[True][1], 2))
    FusedDecodeSteps.run = native_step
    print(json.dumps({"bench": "decoder_step", "dtype": args.dtype, "batch": args.batch, "prompt_tokens": args.prompt_tokens,
                      "tokens_equal": equal, "module_step_ms": module_ms, "native_step_ms": native_ms,
                      "module_median_ms": round(statistics.median(module_ms), 2),
                      "native_median_ms": round(statistics.median(native_ms), 2)}))


if __name__ == "__main__":
    main()
