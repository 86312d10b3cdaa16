"""``vlmd serve [MODEL_DIR]`` (the daemon), ``vlmd convert`` (checkpoint formats) and
``vlmd cost MODEL_DIR`` (what media costs, from the config alone)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Before anything imports torch: its CPU allocator reads this once, at its first allocation.
# Large tensors (weights, packed weights, the KV cache) then sit on 2 MiB transparent huge
# pages (madvise), so a decode step streaming every weight takes a TLB miss per 2 MiB instead
# of per 4 KiB. Measured in one run, small LLaVA decoder, AMD EPYC fam 25 model 17, 2
# threads: a decode step at batch 8 (shared 608-token prefix) 21.5/20.8 -> 18.2/17.5 ms,
# batch 1 16.9/17.1 -> 16.2/15.9 ms. Set THP_MEM_ALLOC_ENABLE=0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# Before anything imports numpy: its OpenBLAS splits a product (the media pool's mel
# spectrograms, for one) over a thread pool of its own, whose threads then spin and take a
# core from the engine (engine/engine_thread.py has the OpenMP side of this). Measured,
# Whisper tiny.en server, 29 s of speech, median of 5 transcriptions, A B A B: 1.114 / 1.396 s
# with OpenBLAS's default, 1.020 / 0.998 s with one thread (AMD EPYC fam 25 model 17, 2 vCPUs).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import structlog  # noqa: E402

from vlmd.cli_flags import add_serve_flags, config_from_flags, refused_flag
from vlmd.config import ServeConfig, cache_dir
from vlmd.logs import LOG_FORMATS

log = structlog.get_logger(__name__)

DEFAULT_MODEL_NAME = "vlmd-tiny-llava"


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="vlmd", description="A multimodal inference server")
    parser.add_argument("--version", action="version", version=f"vlmd {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a checkpoint directory over an OpenAI-compatible HTTP API.",
    )
    add_serve_flags(serve)
    convert = commands.add_parser("convert", help="convert a checkpoint from another format to Hugging Face layout")
    convert.add_argument("--from", dest="source_format", required=True,
                         help="the source format, as an installed plugin registers it "
                              "(vlmd_whisper: ct2, a CTranslate2 / faster-whisper model directory)")
    convert.add_argument("source", help="the model directory to read")
    convert.add_argument("target", help="the directory to write (created if missing)")
    from vlmd.cost import add_parser as add_cost_parser

    cost = add_cost_parser(commands)
    for command in (serve, convert):
        command.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log threshold (default: info)")
        command.add_argument("--log-format", default="auto", choices=LOG_FORMATS,
                             help="text (readable lines), json (one object a line), or auto: text when "
                                  "stderr is a terminal, json otherwise (default: auto)")
    return parser, {"serve": serve, "convert": convert, "cost": cost}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vlmd")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def check_model_dir(path: str) -> None:
    """Fail before anything loads when MODEL_DIR cannot be a checkpoint directory."""
    model_dir = Path(path).expanduser()
    if not model_dir.exists():
        raise ValueError(f"MODEL_DIR {path!r} does not exist (vlmd serves local checkpoint directories only)")
    if not model_dir.is_dir():
        raise ValueError(f"MODEL_DIR {path!r} is not a directory")
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"MODEL_DIR {path!r} has no config.json: not a Hugging Face checkpoint directory")


def bind_socket(host: str, port: int) -> socket.socket:
    """Listen before the model loads, so a taken port is found in milliseconds, not after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as exc:  # the name, not the port: another port would not help
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: --host {host!r} does not resolve ({exc.strerror})") from None
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another --port)") from None
    sock.listen(1024)
    return sock


def default_model_dir() -> Path:
    """The embedded default: a tiny LLaVA built once into the cache directory."""
    from vlmd.tiny import build_tiny

    cache = cache_dir()
    target = cache / "models" / "tiny-llava-seed0"
    if not (target / "config.json").exists():
        log.info("building the embedded default model (a tiny random LLaVA) once", path=str(target))
        staging = cache / "models" / f".tiny-llava-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        build_tiny("llava", staging, seed=0, size="tiny")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def serve(config: ServeConfig, sock: socket.socket, log_level: str = "info", max_connections: int | None = None) -> None:
    """``max_connections``: the bound found by ``connection_bound`` (default: found here).

    The socket is served from the start: while the model loads (weights, profile, warm-up:
    seconds to minutes), every route answers a prompt 503 ("loading", ``Retry-After``), so a
    readiness probe or a client is answered rather than held in the listen backlog."""
    import uvloop

    from vlmd.engine.async_engine import AsyncEngine
    from vlmd.engine.builder import build_engine, warm_up
    from vlmd.engine.engine_thread import EngineThread, single_threaded_torch
    from vlmd.engine.worker import EngineWorker
    from vlmd.server.admission import Admission
    from vlmd.server.app import create_app
    from vlmd.server.connections import ConnectionBound, connection_bound
    from vlmd.server.metrics import Metrics
    from vlmd.server.run import run
    from vlmd.server.state import ServerState

    bound = ConnectionBound(max_connections or connection_bound(config.max_connections))
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    # Built and stepped on one thread, the only one whose torch ops run in parallel
    # (engine_thread.py: a second OpenMP team slows every step by a quarter).
    engine_thread = EngineThread()
    state = ServerState(config=config)  # not ready: every route answers 503 "loading"
    app = create_app(state)
    started: dict = {}  # what the load started, for the shutdown

    async def load() -> None:
        """On the loop, while it serves the loading answers: the engine is built and warmed
        on its thread, the rest here."""
        built = await asyncio.wrap_future(engine_thread.submit(lambda: build_engine(config, log_level)))
        executor = started["executor"] = built.core.executor
        if config.warmup:
            await asyncio.wrap_future(engine_thread.submit(lambda: warm_up(built)))
        engine = AsyncEngine(loop)
        pool = started["pool"] = ThreadPoolExecutor(config.preprocess_threads, thread_name_prefix="vlmd-preprocess",
                                                    initializer=single_threaded_torch)
        admission = Admission(
            pool, engine, threads=config.preprocess_threads, max_queue=config.max_preprocess_queue,
            max_waiting=config.max_waiting_requests, timeout_s=config.preprocess_timeout,
            media_budget_bytes=int(config.max_inflight_media_gb * 2**30), max_body_bytes=config.max_request_bytes,
        )
        metrics = Metrics(engine, built.preprocessor.processor.cache, built.grammar_compiler, built.memory_plan,
                          admission=admission, connections=bound, model_name=config.model_name)
        # Observed from here on, not from construction: the start-up profile and the warm-up run
        # the same processor, and the histograms count clients' work only.
        if built.grammar_compiler is not None:
            built.grammar_compiler.observer = metrics
        built.preprocessor.observer = metrics
        built.preprocessor.processor.observer = metrics
        if config.encoder_urls:  # after the warm-up: it encodes here, whether or not they are up yet
            from vlmd.processing.remote_encoder import RemoteEncoders

            built.preprocessor.remote_encoders = RemoteEncoders(
                config.encoder_urls, config.model_name, config.encoder_timeout_s, config.encoder_fallback,
                built.preprocessor.info.encoder_output_width(), config.encoder_api_key,
                is_resident=lambda identifier: identifier in executor.encoder_outputs, observer=metrics,
            )
        worker = started["worker"] = EngineWorker(built.core, engine.post_deltas, built.torch_threads,
                                                  observe_step=metrics.observe_step, thread=engine_thread)
        engine.attach(worker)
        worker.start()
        grammar_queue = None
        if built.grammar_compiler is not None:
            from vlmd.structured.compile_queue import CompileQueue

            grammar_queue = started["grammar_queue"] = CompileQueue(built.grammar_compiler.compile,
                                                                    timeout_s=config.max_grammar_compile_s)
        state.become_ready(
            engine=engine,
            preprocessor=built.preprocessor,
            tokenizer=built.tokenizer,
            eos_token_ids=built.eos_token_ids,
            max_model_len=built.max_model_len,
            pool=pool,
            metrics=metrics,
            admission=admission,
            created=int(time.time()),
            transcriber=built.transcriber,
            grammar_compiler=built.grammar_compiler,
            grammar_queue=grammar_queue,
        )
        executor.on_failure(lambda message: loop.call_soon_threadsafe(_fail_server, state, message))
        log.info("serving", model=config.model_name, url=_url(config))

    try:
        # Said at once: reading weights, profiling and warming up take seconds with nothing
        # else to say, and the loading answers start with it.
        run(app, sock, loop, bound=bound, keepalive_timeout=config.keepalive_timeout, load=load,
            on_listening=lambda: log.info("loading", model_dir=config.model, listening=_url(config)),
            on_ready=lambda: log.info("ready", url=_url(config), model=config.model_name, max_connections=bound.bound))
    finally:
        if "worker" in started:
            started["worker"].stop()
        if "executor" in started:
            started["executor"].shutdown()
        # Last: the tensor-parallel ranks were started from this thread, and the kernel kills
        # a child whose parent thread ends (rank_process._die_with_parent, PR_SET_PDEATHSIG).
        engine_thread.close(timeout=10.0)
        if "pool" in started:
            started["pool"].shutdown(wait=False, cancel_futures=True)
        if "grammar_queue" in started:
            started["grammar_queue"].shutdown()
        log.info("shut down", model=config.model_name)
    if state.fatal_error is not None:
        log.error("exiting after a tensor-parallel failure", reason=state.fatal_error)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip interpreter teardown: a process group that lost a peer aborts there


def _url(config: ServeConfig) -> str:
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"http://{host}:{config.port}"


# Seconds between a fatal engine failure and the exit: in-flight requests get their errors first.
FAILURE_GRACE_S = 1.0


def _fail_server(state, message: str) -> None:
    """On the event loop: /health turns 503 now; the server stops (exit 1) shortly after."""
    import signal

    if state.fatal_error is None:
        state.fatal_error = message
        state.engine.loop.call_later(FAILURE_GRACE_S, os.kill, os.getpid(), signal.SIGTERM)


def _serve_command(args: argparse.Namespace) -> None:
    refused = refused_flag(args)
    if refused:
        raise ValueError(refused)
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            raise ValueError(f"MODEL_DIR {args.model!r} and --model {args.model_flag!r} differ: give one")
        args.model = args.model_flag
    config = config_from_flags(args, model=args.model or "")  # validates every setting
    from vlmd.layers.cpu import library

    os.environ[library.ENV] = config.cpu_kernels  # for this process and the tensor-parallel ranks it starts
    try:
        library.load()  # a variant this CPU cannot run, or one not built, is refused here
    except library.VariantError as exc:
        raise ValueError(f"--cpu-kernels {exc.requested}: {exc.reason}") from None
    if args.model is not None:
        check_model_dir(args.model)
    if config.node_rank > 0:  # ranks only, no HTTP: MODEL_DIR must be the same checkpoint as node 0's
        if args.model is None:
            raise ValueError("--node-rank > 0 needs MODEL_DIR (the same checkpoint as node 0's)")
        from vlmd.engine.rank_launcher import run_node
        from vlmd.engine.tp_startup import world_spec_of

        sys.exit(run_node(world_spec_of(config), config.node_rank, str(Path(config.model).expanduser()),
                          config.dtype, config.torch_threads, args.log_level, config.linear_kernels,
                          config.attention_kernels))
    sock = bind_socket(config.host, config.port)
    from vlmd.server.connections import connection_bound

    max_connections = connection_bound(config.max_connections)  # an explicit bound the host cannot hold fails here
    if args.model is None:
        # On a thread that ends: the tiny build's torch ops leave no OpenMP team (engine_thread.py).
        with ThreadPoolExecutor(1) as once:
            config.model = str(once.submit(default_model_dir).result())
        config.served_model_name = config.served_model_name or DEFAULT_MODEL_NAME
    serve(config, sock, args.log_level, max_connections)


def main(argv: list[str] | None = None) -> None:
    parser, commands = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report it with the usage of the command it was given to
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    from vlmd.logs import configure_logging

    configure_logging(args.log_level, getattr(args, "log_format", None))
    if args.command == "serve":
        from vlmd.logs import FORMAT_ENV, resolve_format

        os.environ[FORMAT_ENV] = resolve_format(args.log_format)  # the rank processes log as we do
        try:
            _serve_command(args)
        except (ValueError, LookupError, OSError) as exc:  # configuration the operator can fix
            sys.exit(f"vlmd serve: {exc}")
    elif args.command == "cost":
        from vlmd.cost import run as run_cost
        from vlmd.errors import VlmdError

        try:
            check_model_dir(args.model)
            print(run_cost(args))
        except (OSError, ValueError, LookupError) as exc:
            sys.exit(f"vlmd cost: {exc}")
        except VlmdError as exc:
            sys.exit(f"vlmd cost: {exc.message}")
    elif args.command == "convert":
        from vlmd.plugins.manager import converters
        from vlmd.plugins.registry import resolve

        known = converters()
        if args.source_format not in known:
            sys.exit(f"vlmd convert: no installed plugin converts from {args.source_format!r}; "
                     f"known formats: {', '.join(sorted(known)) or 'none'}")
        try:
            target = resolve(known[args.source_format])(args.source, args.target)
        except (OSError, ValueError) as exc:
            sys.exit(f"vlmd convert: {exc}")
        print(f"wrote a Hugging Face checkpoint to {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
