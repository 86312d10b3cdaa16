"""Scaling curves: how each server's cost grows with concurrency, image size and context
length, as JSON lines (one per server and point) and one PNG per sweep.

Three sweeps, each selectable (``--sweeps``) with its grid a flag:

- ``concurrency`` (default 1,2,4,8,16,32) on LLaVA-small: 640x480 JPEGs, every image new,
  ``--output-tokens`` with ignore_eos; req/s, TTFT p50 and time per output token (inter-token
  p50). A point sends ``max(--requests, 2 x concurrency)`` requests, so every client sends
  at least two and the point is not only the first burst.
- ``image`` (default 224x224 ... 1920x1080) on Qwen2-VL-small at concurrency 1: prompt tokens
  (the server's ``usage`` for one more image of the size, sent first, which also warms the
  size), TTFT, time per output token. The tiny builder caps Qwen2-VL's
  images at 100,352 pixels (128 tokens), so every size above ~316x316 would cost the same;
  the servers load a copy whose processor allows the largest size in the grid.
- ``context`` (default 1k,4k,16k prompt tokens, chat template included) of text at
  concurrency 1 on Qwen2-VL-small: TTFT and time per output token. Each request's text is
  new from its first word, so no prefix cache helps; its prompt is counted with the
  checkpoint's tokenizer and chat template (no probe request: at 16k that is minutes).

The servers are side_by_side.py's (vLLM-CPU from ``--vllm-venv``, vlmd, and llama.cpp with
``--llama-cpp`` on Qwen2-VL checkpoints, the one family its converter takes here), started
once per checkpoint and all up together; each point runs on each server in turn (the order
reversed every point) while the others' process groups are stopped, so a point's figures
for the servers are seconds apart (why: side_by_side.py's ``--interleave``). A point's
images or texts are the same for every server. A server that fails a point gets a line
with ``error`` and the sweep goes on.

Checkpoints: the tiny builder's (built if missing), widened where the grid needs more
positions or larger images than it declares (scaling_checkpoint.py). Plots: scaling_plot.py.

    python contrib/bench/scaling.py --plot-dir plots > scaling.jsonl
    python contrib/bench/scaling.py --sweeps context --context 1k,4k --context-requests 2
    python contrib/bench/scaling.py --plot-from scaling.jsonl --plot-dir plots
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_peer  # noqa: E402
import side_by_side  # noqa: E402
from bench_chat import make_jpeg, run_level, stream_chat  # noqa: E402
from scaling_checkpoint import QWEN_FACTOR, checkpoint, covering_pixels  # noqa: E402
from scaling_plot import plot, read_lines  # noqa: E402

SWEEPS = ("concurrency", "image", "context")
CONCURRENCY_IMAGE = (640, 480)


def parse_counts(text: str) -> list[int]:
    """``"1,2,4"`` or ``"1k,4k,16k"`` (k = 1024): distinct positive integers, in order given."""
    values = []
    for item in text.split(","):
        item = item.strip().lower()
        scale = 1024 if item.endswith("k") else 1
        digits = item[:-1] if scale > 1 else item
        if not digits.isdigit() or int(digits) <= 0:
            raise ValueError(f"{item!r} in {text!r} is not a positive count (e.g. 8 or 4k)")
        values.append(int(digits) * scale)
    if len(set(values)) != len(values):
        raise ValueError(f"repeated value in {text!r}")
    return values


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"224,1344x756"``: (width, height) pairs; a single number is a square."""
    sizes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) not in (1, 2) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"{item!r} in {text!r} is not a size (e.g. 448 or 1920x1080)")
        sizes.append((int(parts[0]), int(parts[-1])))
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"repeated size in {text!r}")
    return sizes


def with_flag(command: list[str], flag: str, value: str) -> list[str]:
    """``command`` with ``flag``'s value replaced (side_by_side.py's vLLM command fixes
    --max-model-len at 2048, below a 16k point)."""
    if flag not in command:
        raise ValueError(f"{flag} is not in the command {command[:4]}...")
    index = command.index(flag) + 1
    return command[:index] + [value] + command[index + 1:]


def chat_length(tokenizer, text: str) -> int:
    """Tokens of the chat prompt holding ``text`` as the one user message."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def make_text(tokenizer, tokens: int, seed: int) -> str:
    """A user message whose chat prompt is about ``tokens`` long, new from its first word."""
    import numpy as np

    wanted = tokens - (chat_length(tokenizer, "x") - len(tokenizer.encode("x", add_special_tokens=False)))
    if wanted <= 8:
        raise ValueError(f"{tokens} tokens leave no room for text after the chat template")
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words, ids = [f"Note {seed}:"], []
    while len(ids) < wanted:
        words += ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(wanted)]
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
    return tokenizer.decode(ids[:wanted])


def summarise(results: list[tuple], elapsed: float) -> dict:
    """run_level's figures for (TTFT, gaps, seconds) triples."""
    ttfts = sorted(r[0] for r in results)
    gaps = [g for r in results for g in r[1]]
    return {"requests": len(results), "req_per_s": round(len(results) / elapsed, 3),
            "ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4),
            "itl_p50_s": round(statistics.median(gaps), 5) if gaps else None, "wall_s": round(elapsed, 2)}


def text_body(text: str, output_tokens: int) -> dict:
    """bench_chat.py's request with ``text`` as the message instead of an image and a question."""
    return {"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": output_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}


async def run_texts(url: str, texts: list[str], output_tokens: int) -> dict:
    """The texts one after the other (concurrency 1), streamed."""
    connector = aiohttp.TCPConnector(force_close=True)  # as run_level: llama.cpp closes after a stream
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=connector) as session:
        started = time.perf_counter()
        results = [await stream_chat(session, url, text_body(text, output_tokens)) for text in texts]
        return summarise(results, time.perf_counter() - started)


class Point:
    """One x of one sweep: its inputs (the same for every server) and how to measure them."""

    def __init__(self, sweep: str, value, index: int, args, tokenizer=None):
        self.sweep, self.index = sweep, index
        base = args.seed + 100_000 * (SWEEPS.index(sweep) + 1) + 1000 * index
        if sweep == "concurrency":
            self.x, self.x_label, self.concurrency = value, str(value), value
            width, height = CONCURRENCY_IMAGE
            self.inputs = [make_jpeg(base + i, width, height) for i in range(max(args.requests, 2 * value))]
            self.probe = make_jpeg(base + 999, width, height)
        elif sweep == "image":
            width, height = value
            self.x, self.x_label, self.concurrency = width * height, f"{width}x{height}", 1
            self.inputs = [make_jpeg(base + i, width, height) for i in range(args.image_requests)]
            self.probe = make_jpeg(base + 999, width, height)
        else:
            self.x, self.x_label, self.concurrency = value, f"{value // 1024}k" if value % 1024 == 0 else str(value), 1
            self.inputs = [make_text(tokenizer, value, base + i) for i in range(args.context_requests)]
            # No probe: at 16k one more prefill is minutes; the checkpoint's tokenizer and chat
            # template count the prompt (vLLM's and vlmd's usage agree with it).
            self.probe, self.prompt_tokens = None, chat_length(tokenizer, self.inputs[0])

    def measure(self, url: str, output_tokens: int, timeout_s: float) -> dict:
        """The probe first (the server's prompt_tokens; it also warms this shape), then the
        point's requests, abandoned (the client disconnects) after ``timeout_s``."""
        if self.sweep == "context":
            prompt, source = self.prompt_tokens, "tokenizer"
            work = run_texts(url, self.inputs, output_tokens)
        else:
            prompt, source = side_by_side.prompt_tokens(url, self.probe), "server"
            work = run_level(url, "bench", self.concurrency, len(self.inputs), output_tokens, self.inputs)
        figures = asyncio.run(asyncio.wait_for(work, timeout_s))
        return {"prompt_tokens": prompt, "prompt_tokens_from": source, **figures}


def servers_for(family: str, model_dir: str, max_model_len: int, slots: int, args) -> dict:
    """name -> (command, env, port), as side_by_side.py's main builds them."""
    servers: dict = {}
    if args.llama_cpp is not None and family != "qwen2_vl":
        print(f"llama.cpp left out of the {family} sweeps: its converter takes Qwen2-VL here", file=sys.stderr)
    elif args.llama_cpp is not None:
        gguf, mmproj = llama_cpp_peer.convert(model_dir, args.llama_cpp, args.llama_cpp_python, "f32")
        servers["llama.cpp"] = (*llama_cpp_peer.command(args.llama_cpp, model_dir, gguf, mmproj, args.port + 2,
                                                        slots, max_model_len), args.port + 2)
    if args.no_vllm:
        pass
    elif (args.vllm_venv / "bin" / "python").exists():
        for sub in ("tmp", "cache"):
            (args.vllm_work / sub).mkdir(parents=True, exist_ok=True)
        command, env = side_by_side.vllm_command(args.vllm_venv, model_dir, args.port, args.dtype, args.vllm_work)
        servers["vllm"] = (with_flag(command, "--max-model-len", str(max_model_len)), env, args.port)
    else:
        print(f"no vLLM venv at {args.vllm_venv}: measuring vlmd only", file=sys.stderr)
    servers["vlmd"] = (*side_by_side.vlmd_command(model_dir, args.port + 1, args.dtype,
                                                  ["--max-model-len", str(max_model_len), *args.vlmd_flag]),
                       args.port + 1)
    return servers


def run_group(family: str, sweeps: list[str], grids: dict, args) -> list[dict]:
    """Every sweep that uses ``family``'s checkpoint, against servers started once for them."""
    longest = max(grids["context"]) if "context" in sweeps else 0
    max_pixels = covering_pixels(grids["image"]) if "image" in sweeps and family != "llava" else None
    image_tokens = max_pixels // QWEN_FACTOR**2 if max_pixels else 1024
    # the longest prompt + output + a margin for the chat template; 2048 at least, as side_by_side.py serves
    max_model_len = max(2048, longest + args.output_tokens + 256, image_tokens + args.output_tokens + 256)
    model_dir = checkpoint(family, args.size, args.model_dir.get(family), max_model_len, max_pixels)
    slots = max(grids["concurrency"]) if "concurrency" in sweeps else 1
    servers = servers_for(family, model_dir, max_model_len, slots, args)
    tokenizer = None
    if "context" in sweeps:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    started, lines = {}, []
    try:
        for name, (command, env, port) in servers.items():
            started[name], startup = side_by_side.start(name, command, env, port, args.startup_timeout)
            print(f"{name} up in {startup:.0f} s on {model_dir}", file=sys.stderr)
        for name in started:  # one short request outside the measurements
            url = f"http://127.0.0.1:{servers[name][2]}"
            asyncio.run(run_level(url, "bench", 1, 1, 4, [make_jpeg(args.seed - 1, *CONCURRENCY_IMAGE)]))
        for process in started.values():
            os.killpg(process.pid, signal.SIGSTOP)
        names = list(started)
        for sweep in sweeps:
            for index, value in enumerate(grids[sweep]):
                point = Point(sweep, value, index, args, tokenizer)
                for name in names if index % 2 == 0 else names[::-1]:
                    lines.append(measure_on(name, started[name], servers[name][2], point, family, model_dir, args))
                    print(json.dumps(lines[-1]), flush=True)
    finally:
        for process in started.values():
            try:
                os.killpg(process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            side_by_side.stop(process)
    return lines


def measure_on(name: str, process, port: int, point: Point, family: str, model_dir: str, args) -> dict:
    """One server's figures for one point, with the others stopped; an ``error`` if it failed."""
    line = {"sweep": point.sweep, "server": name, "x": point.x, "x_label": point.x_label,
            "concurrency": point.concurrency, "family": family, "model": model_dir, "dtype": args.dtype,
            "output_tokens": args.output_tokens, "seed": args.seed,
            "loadavg": [round(v, 2) for v in os.getloadavg()],
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        os.killpg(process.pid, signal.SIGCONT)
        line.update(point.measure(f"http://127.0.0.1:{port}", args.output_tokens, args.point_timeout))
    except Exception as error:  # noqa: BLE001 - a peer's failure at one point is a result, not the end
        line["error"] = f"{type(error).__name__}: {error}"[:500] if str(error) else type(error).__name__
        print(f"{name} failed {point.sweep}={point.x_label}: {line['error']}", file=sys.stderr)
    finally:
        try:
            os.killpg(process.pid, signal.SIGSTOP)
        except ProcessLookupError:  # it died: its error is in the line
            pass
    return line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", default=",".join(SWEEPS), help=f"comma-separated, of {', '.join(SWEEPS)}")
    parser.add_argument("--concurrency", type=parse_counts, default=parse_counts("1,2,4,8,16,32"))
    parser.add_argument("--image-sizes", type=parse_sizes,
                        default=parse_sizes("224,448,896,1344x756,1920x1080"), help="WxH or W (square)")
    parser.add_argument("--context", type=parse_counts, default=parse_counts("1k,4k,16k"),
                        help="prompt tokens, chat template included (k = 1024)")
    parser.add_argument("--requests", type=int, default=16, help="concurrency sweep: requests a point "
                        "(at least 2 x the concurrency)")
    parser.add_argument("--image-requests", type=int, default=6, help="image sweep: requests a point")
    parser.add_argument("--context-requests", type=int, default=3, help="context sweep: requests a point")
    parser.add_argument("--concurrency-family", default="llava", choices=side_by_side.IMAGE_FAMILIES)
    parser.add_argument("--image-family", default="qwen2_vl", choices=side_by_side.IMAGE_FAMILIES)
    parser.add_argument("--context-family", default="qwen2_vl", choices=side_by_side.IMAGE_FAMILIES)
    parser.add_argument("--model-dir", action="append", default=[], metavar="FAMILY=DIR",
                        help="a family's checkpoint instead of the tiny builder's (repeatable)")
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 1_000_000, help="input seed base (fresh per run)")
    side_by_side.add_server_arguments(parser)
    parser.add_argument("--point-timeout", type=float, default=1800,
                        help="seconds one server may take on one point's requests; then its line has an error")
    parser.add_argument("--port", type=int, default=8323)
    parser.add_argument("--plot-dir", type=Path, help="write scaling_<sweep>.png here")
    parser.add_argument("--plot-from", type=Path, metavar="FILE.jsonl",
                        help="draw the plots from a saved run's lines; starts no server")
    args = parser.parse_args(argv)
    args.sweeps = [s.strip() for s in args.sweeps.split(",") if s.strip()]
    unknown = set(args.sweeps) - set(SWEEPS)
    if unknown or not args.sweeps:
        parser.error(f"--sweeps: unknown {sorted(unknown)}; choose from {', '.join(SWEEPS)}")
    if min(args.requests, args.image_requests, args.context_requests, args.output_tokens) < 1:
        parser.error("request counts and --output-tokens must be at least 1")
    if max(args.requests, 2 * max(args.concurrency), args.image_requests, args.context_requests) >= 999:
        parser.error("at most 998 requests a point: a point's input seeds are 1000 apart, its probe's is the 999th")
    if args.point_timeout <= 0:
        parser.error("--point-timeout must be positive")
    if args.plot_from is not None and args.plot_dir is None:
        parser.error("--plot-from needs --plot-dir")
    pairs = [item.split("=", 1) for item in args.model_dir]
    if any(len(pair) != 2 for pair in pairs):
        parser.error("--model-dir takes FAMILY=DIR")
    args.model_dir = dict(pairs)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # `timeout` and `kill` send SIGTERM: as an exception, so run_group stops its servers
    # (they are in their own sessions and would outlive this process, perhaps SIGSTOPped).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.plot_from is not None:
        lines = read_lines(args.plot_from)
    else:
        grids = {"concurrency": args.concurrency, "image": args.image_sizes,
                 "context": args.context}
        families = {"concurrency": args.concurrency_family, "image": args.image_family, "context": args.context_family}
        lines = []
        for family in dict.fromkeys(families[sweep] for sweep in args.sweeps):  # one server start per checkpoint
            lines += run_group(family, [s for s in args.sweeps if families[s] == family], grids, args)
    if args.plot_dir is not None:
        for path in plot(lines, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
