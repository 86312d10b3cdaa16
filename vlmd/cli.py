"""``vlmd serve [MODEL_DIR]`` (the daemon), ``vlmd convert`` (checkpoint formats) and
``vlmd cost MODEL_DIR`` (what media costs, from the config alone)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vlmd.config import ServeConfig, parse_json_object, parse_limit_mm_per_prompt

DEFAULT_MODEL_NAME = "vlmd-tiny-llava"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmd", description="A multimodal inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("model", nargs="?", help="checkpoint directory (default: a built-in tiny LLaVA)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--kv-cache-gb", type=float, default=4.0, help="memory for the KV cache (GiB)")
    serve.add_argument("--num-kv-blocks", type=int, help="exact number of KV blocks (overrides --kv-cache-gb)")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--limit-mm-per-prompt", default="", help="e.g. image=2,video=1")
    serve.add_argument("--allowed-local-media-path", help="directory file:// media URLs may read from")
    serve.add_argument("--allow-private-media-urls", action="store_true",
                       help="let http(s) media URLs reach private, loopback and link-local addresses")
    serve.add_argument("--allowed-media-domains", help="comma-separated hosts http(s) media may come from")
    serve.add_argument("--preprocess-threads", type=int, default=4)
    serve.add_argument("--torch-threads", type=int, help="intra-op threads of the engine thread")
    serve.add_argument("--disable-chunked-mm-input", action="store_true")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="share KV blocks of identical prefixes, images included (default: on)")
    serve.add_argument("--mm-processor-cache-gb", type=float, default=4.0,
                       help="processed-media cache on the front end (GiB; 0 disables)")
    serve.add_argument("--max-num-encoder-input-tokens", type=int,
                       help="encoder work per step, in output tokens (default: --max-num-batched-tokens)")
    serve.add_argument("--encoder-cache-size", type=int,
                       help="encoder outputs kept, in tokens (default: --max-num-batched-tokens)")
    serve.add_argument("--mm-processor-kwargs", default="",
                       help='processor settings for every request, JSON, e.g. \'{"max_pixels": 100352}\'')
    serve.add_argument("--media-io-kwargs", default="",
                       help='media decode settings, JSON, e.g. \'{"video": {"num_frames": 16}, '
                            '"audio": {"max_duration_s": 600}}\'')
    serve.add_argument("--api-key", default=os.environ.get("VLMD_API_KEY"))
    serve.add_argument("--no-warmup", action="store_true", help="skip the warm-up request at start-up")
    serve.add_argument("--log-level", default="info")
    convert = commands.add_parser("convert", help="convert a checkpoint from another format to Hugging Face layout")
    convert.add_argument("--from", dest="source_format", required=True, choices=["ct2"],
                         help="ct2: a CTranslate2 (faster-whisper) Whisper model directory")
    convert.add_argument("source", help="the model directory to read")
    convert.add_argument("target", help="the directory to write (created if missing)")
    convert.add_argument("--log-level", default="info")
    from vlmd.cost import add_parser as add_cost_parser

    add_cost_parser(commands)
    return parser


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    model = args.model
    served_name = args.served_model_name
    if model is None:
        model = str(default_model_dir())
        served_name = served_name or DEFAULT_MODEL_NAME
    domains = tuple(d.strip() for d in args.allowed_media_domains.split(",")) if args.allowed_media_domains else None
    return ServeConfig(
        model=model,
        served_model_name=served_name,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_gb=args.kv_cache_gb,
        num_kv_blocks=args.num_kv_blocks,
        seed=args.seed,
        limit_mm_per_prompt=parse_limit_mm_per_prompt(args.limit_mm_per_prompt),
        allowed_local_media_path=args.allowed_local_media_path,
        allow_private_media_urls=args.allow_private_media_urls,
        allowed_media_domains=domains,
        preprocess_threads=args.preprocess_threads,
        torch_threads=args.torch_threads,
        disable_chunked_mm_input=args.disable_chunked_mm_input,
        enable_prefix_caching=args.enable_prefix_caching,
        mm_processor_cache_gb=args.mm_processor_cache_gb,
        max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
        encoder_cache_size=args.encoder_cache_size,
        mm_processor_kwargs=parse_json_object(args.mm_processor_kwargs, "--mm-processor-kwargs"),
        media_io_kwargs=parse_json_object(args.media_io_kwargs, "--media-io-kwargs"),
        api_key=args.api_key,
        warmup=not args.no_warmup,
    )


def default_model_dir() -> Path:
    """The embedded default: a tiny LLaVA built once into the cache directory."""
    from vlmd.testing.tiny import build_tiny

    cache = Path(os.environ.get("VLMD_CACHE_DIR", Path.home() / ".cache" / "vlmd"))
    target = cache / "models" / "tiny-llava-seed0"
    if not (target / "config.json").exists():
        staging = cache / "models" / f".tiny-llava-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        build_tiny("llava", staging, seed=0, size="tiny")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def serve(config: ServeConfig) -> None:
    import uvloop
    from aiohttp import web

    from vlmd.engine.async_engine import AsyncEngine
    from vlmd.engine.builder import build_engine, warm_up
    from vlmd.engine.worker import EngineWorker
    from vlmd.server.app import create_app
    from vlmd.server.metrics import Metrics
    from vlmd.server.state import ServerState

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    built = build_engine(config)
    if config.warmup:
        warm_up(built)
    engine = AsyncEngine(loop)
    metrics = Metrics(engine, built.preprocessor.processor.cache)
    built.preprocessor.observer = metrics
    built.preprocessor.processor.observer = metrics
    worker = EngineWorker(built.core, engine.post_deltas, config.torch_threads, observe_step=metrics.observe_step)
    engine.attach(worker)
    worker.start()
    state = ServerState(
        config=config,
        engine=engine,
        preprocessor=built.preprocessor,
        tokenizer=built.tokenizer,
        eos_token_ids=built.eos_token_ids,
        max_model_len=built.max_model_len,
        pool=ThreadPoolExecutor(config.preprocess_threads, thread_name_prefix="vlmd-preprocess"),
        created=int(time.time()),
    )
    state.metrics = metrics
    state.transcriber = built.transcriber
    app = create_app(state)
    try:
        web.run_app(
            app, host=config.host, port=config.port, loop=loop, handler_cancellation=True,
            access_log=None, print=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
    finally:
        worker.stop()
        state.pool.shutdown(wait=False, cancel_futures=True)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    from vlmd.logs import configure_logging

    configure_logging(args.log_level)
    if args.command == "serve":
        serve(config_from_args(args))
    elif args.command == "cost":
        from vlmd.cost import run as run_cost
        from vlmd.errors import VlmdError

        try:
            print(run_cost(args))
        except (OSError, ValueError, LookupError) as exc:
            sys.exit(f"vlmd cost: {exc}")
        except VlmdError as exc:
            sys.exit(f"vlmd cost: {exc.message}")
    elif args.command == "convert":
        from vlmd.convert.ct2_whisper import convert_ct2_whisper

        try:
            target = convert_ct2_whisper(args.source, args.target)
        except (OSError, ValueError) as exc:
            sys.exit(f"vlmd convert: {exc}")
        print(f"wrote a Hugging Face checkpoint to {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
