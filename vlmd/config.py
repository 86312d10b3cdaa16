"""Server-wide settings, from the command line. Torch-free."""

from __future__ import annotations

import os
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path

from vlmd.errors import BadRequestError
from vlmd.layers.cpu import variants as cpu_kernel_variants


def setting(default, help: str, *, parse=None, metavar: str | None = None, choices=None,
            negatable: bool = False, env: str | None = None, minimum: float | None = None,
            maximum: float | None = None,
            default_factory=None):
    """One serve setting: its default, its ``--flag`` help, and how the flag's text becomes the value.

    ``vlmd/cli_flags.py`` builds the ``vlmd serve`` flags from these fields alone, so a
    setting is defined once: name (the flag is ``--name-with-dashes``), type, default, help.
    ``parse`` turns the flag's text into the value (default: the field's type); ``negatable``
    gives a boolean both ``--x`` and ``--no-x``; ``env`` names an environment variable that
    supplies the default; ``minimum`` / ``maximum`` bound the values accepted (checked by
    ``ServeConfig.validate``).
    """
    metadata = {"help": help, "parse": parse, "metavar": metavar, "choices": choices,
                "negatable": negatable, "env": env, "minimum": minimum,
                "maximum": maximum}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


CACHE_DIR_ENV = "VLMD_CACHE_DIR"


def cache_dir(environ=os.environ) -> Path:
    """Where vlmd keeps what it builds once (the embedded default model, bench checkpoints):
    ``$VLMD_CACHE_DIR``, else ``~/.cache/vlmd``. The only reader of the variable, so a server,
    its tests and the benches agree on the place; ``environ`` lets a test ask about a child's."""
    configured = environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "vlmd"


def setting_default(spec: Field):
    """A setting's default value (a fresh one for the ``default_factory`` kinds)."""
    if spec.default is not MISSING:
        return spec.default
    if spec.default_factory is not MISSING:
        return spec.default_factory()
    return None


def serve_setting(name: str) -> Field:
    """The ``ServeConfig`` field ``name``, for a command that takes one of serve's settings
    (``vlmd cost``): its default, help and choices are then defined here only."""
    for spec in fields(ServeConfig):
        if spec.name == name:
            return spec
    raise KeyError(f"ServeConfig has no setting {name!r}")


def _comma_list(text: str) -> tuple[str, ...] | None:
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    return items or None


# The values of --linear-kernels and --attention-kernels, defined once: the layers that
# take them validate against these.
LINEAR_KERNEL_MODES = ("auto", "plain", "packed", "native")
ATTENTION_KERNEL_MODES = ("auto", "torch", "flex")
# The values of --quantization (layers/linear/quantize.py).
QUANTIZATIONS = ("none", "int8")

# The KV cache of a CPU server given no size and no --memory-utilization (engine/sizing.py);
# `vlmd cost` without --memory-gb sizes its cache the same way.
DEFAULT_CPU_KV_CACHE_GB = 4.0


@dataclass
class ServeConfig:
    model: str = field(metadata={"help": "checkpoint directory (default: a built-in tiny LLaVA, built on first start)",
                                 "positional": True})
    served_model_name: str | None = setting(None, "the model name clients send (default: MODEL_DIR)")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "TCP port to listen on (bound before the model loads)", minimum=0, maximum=65535)
    dtype: str = setting("float32", "weights and activations dtype", choices=("float32", "bfloat16", "float16"))
    linear_kernels: str = setting(
        "auto", "how linear layers pick their kernel: auto (timed at start-up), plain (F.linear), "
        "packed (oneDNN pre-packed where available), native (pre-packed, and vlmd's CPU kernel "
        "for products of up to 32 rows where it reads the packed weight)", choices=LINEAR_KERNEL_MODES)
    quantization: str = setting(
        "none", "weight-only quantization of the decoder's linear layers and LM head at load time: none, or int8 "
        "(per output channel, symmetric, from float32 weights; CPU, --dtype float32; embeddings and encoders stay "
        "float; accuracy bound in docs/decisions.md)", choices=QUANTIZATIONS)
    attention_kernels: str = setting(
        "auto", "how attention runs: auto (on the CPU vlmd's CPU kernels, where the install built them, for "
        "decodes and float32 prefill chunks, else torch ops; on CUDA torch's FlexAttention, decodes under CUDA "
        "graphs), torch (the paged backend's torch ops only), flex (FlexAttention; on the CPU run eagerly, for tests)",
        choices=ATTENTION_KERNEL_MODES)
    cpu_kernels: str = setting(
        "auto", "which build of vlmd's CPU kernels to load (they are built with the package, one library per "
        "instruction-set level): auto (the best this CPU runs), or a level this CPU runs, e.g. x86-64-v3 "
        "(AVX2) on an AVX-512 host", choices=("auto",) + cpu_kernel_variants.NAMES, env=cpu_kernel_variants.ENV)
    chat_template: str | None = setting(
        None, "a Jinja chat template, as a file path or the template text, used instead of the checkpoint's",
        parse=lambda text: resolve_chat_template(text), metavar="FILE|TEMPLATE")
    max_model_len: int | None = setting(None, "longest prompt + output, in tokens (default: the checkpoint's)", minimum=1)
    max_num_seqs: int = setting(256, "most requests in one step", minimum=1)
    max_num_batched_tokens: int = setting(2048, "token budget of one step (prefill chunks + decodes)", minimum=1)
    block_size: int = setting(16, "tokens per KV-cache block", minimum=1)
    device: str = setting(
        "auto", "where weights, KV cache and step tensors live: auto (cuda if available, else cpu), cpu, cuda, cuda:N",
        parse=lambda text: parse_device(text), metavar="DEVICE")
    kv_cache_gb: float | None = setting(
        None, "memory for the KV cache, GiB; overrides the utilisation settings "
        f"(default: {DEFAULT_CPU_KV_CACHE_GB:g} on CPU, what --gpu-memory-utilization leaves on CUDA)", minimum=0)
    num_kv_blocks: int | None = setting(None, "exact number of KV blocks (overrides --kv-cache-gb)", minimum=1)
    gpu_memory_utilization: float = setting(
        0.9, "CUDA: fraction of the GPU's memory this server may use; the KV cache gets what weights, the "
        "start-up profile's peak and the encoder cache leave", minimum=0)
    memory_utilization: float | None = setting(
        None, "CPU: fraction of the host's memory (or cgroup limit) this server may use in all; the KV cache "
        "gets what the process, the start-up profile's peak and the encoder cache leave", minimum=0)
    seed: int = setting(0, "seed of the sampler for requests without their own")
    limit_mm_per_prompt: dict[str, int] = setting(
        None, "most media items of each modality in one prompt, e.g. image=2,video=1 or JSON",
        parse=lambda text: parse_limit_mm_per_prompt(text), metavar="MODALITY=N,...", default_factory=dict)
    allowed_local_media_path: str | None = setting(None, "directory that file:// media URLs may read from")
    allow_private_media_urls: bool = setting(
        False, "let http(s) media URLs reach private, loopback and link-local addresses")
    allowed_media_domains: tuple[str, ...] | None = setting(
        None, "comma-separated hosts that http(s) media may come from (default: any public host)",
        parse=_comma_list, metavar="HOST,...")
    media_max_bytes: int = setting(20 * 2**20, "largest fetched image or video, in bytes", minimum=1)
    media_timeout_s: float = setting(10.0, "seconds allowed to fetch one media URL", minimum=0)
    preprocess_threads: int = setting(4, "threads that fetch, decode and preprocess media", minimum=1)
    torch_threads: int | None = setting(
        None, "intra-op threads of the engine thread, of each rank under tensor parallelism "
        "(default: 1 for a CPU model whose weights fit in half the last-level cache, else "
        "torch's; with ranks, this host's cores divided among its ranks)", minimum=1)
    disable_chunked_mm_input: bool = setting(False, "schedule each media item's placeholders in one step")
    short_prefill_tokens: int = setting(
        256, "a waiting prompt of at most this many tokens and no media is short: a step runs it with the "
        "decodes alone, before longer waiting prompts, with no encoder work and no longer prefill (those go on "
        "the next step; at most every other step is such a step); 0 schedules in arrival order only", minimum=0)
    long_prefill_step_tokens: int = setting(
        256, "while more than one request is in the engine, the prefill chunks of prompts that are not short "
        "(longer than --short-prefill-tokens, or with media) take at most this many tokens of a step together, "
        "so a step stays short for a request that waits for it; a request alone keeps all of "
        "--max-num-batched-tokens. Per step, unlike vLLM's per-request --long-prefill-token-threshold; 0: off",
        minimum=0)
    enable_prefix_caching: bool = setting(
        True, "share KV blocks of identical prefixes, media included", negatable=True)
    mm_processor_cache_gb: float = setting(4.0, "processed-media cache on the front end, GiB (0 disables)", minimum=0)
    max_num_encoder_input_tokens: int | None = setting(
        None, "encoder work per step, in output tokens (default: the largest item's, so one item a step; for a model "
        "that cross-attends, --max-num-batched-tokens)", minimum=1)
    encoder_cache_size: int | None = setting(
        None, "encoder outputs kept, in tokens (default: --max-num-batched-tokens)", minimum=1)
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on every route but /health", env="VLMD_API_KEY")
    # Server-wide processor settings (e.g. {"max_pixels": N}); a request's own
    # mm_processor_kwargs are merged over them.
    mm_processor_kwargs: dict = setting(
        None, 'processor settings for every request, JSON, e.g. \'{"max_pixels": 100352}\'',
        parse=lambda text: parse_json_object(text, "--mm-processor-kwargs"), metavar="JSON",
        default_factory=dict)
    # Decode settings per modality, e.g. {"video": {"num_frames": 16}} (see MEDIA_IO_FIELDS).
    media_io_kwargs: dict = setting(
        None, 'media decode settings, JSON, e.g. \'{"video": {"num_frames": 16}, "audio": {"max_duration_s": 600}}\'',
        parse=lambda text: parse_json_object(text, "--media-io-kwargs"), metavar="JSON", default_factory=dict)
    max_request_bytes: int = setting(64 * 2**20, "largest request body, in bytes", minimum=1)
    max_request_json_values: int = setting(
        2**18, "most JSON values in a request body (counted from above as it arrives: its commas and opening "
        "brackets); a body past it is a 400, never parsed: a parse holds the event loop ~1 us a value. Raise it "
        "for /v1/completions batches of more token ids", minimum=1)
    request_read_timeout: float = setting(
        30.0, "seconds a request body may take to arrive once its headers have (a slower one is a 408 and the "
        "connection is closed)", minimum=0.001)
    request_min_body_rate: int = setting(
        65536, "bytes per second a request body must keep arriving at: each byte received extends the "
        "--request-read-timeout deadline by 1/rate s, so a large upload on a slow link is read while a client "
        "that stalls or trickles is cut off (a 408)", minimum=1)
    keepalive_timeout: float = setting(
        5.0, "seconds an idle keep-alive connection stays open between requests (uvicorn's default, so vLLM's)",
        minimum=0)
    max_connections: int | None = setting(
        None, "open client connections served at once; past it 16 more may ask /health, /ping, /metrics or "
        "/get_load (one answer each; anything else a 503), and further ones are closed as accepted. Each holds a "
        "file descriptor, and a process out of them accepts no one, monitors included (default: 4096, the "
        "open-file limit raised to fit it and 272 descriptors more, up to the hard limit; below that, what fits)",
        minimum=1)
    # Structured outputs: a grammar's compile time grows faster than its size (llguidance,
    # tiny LLaVA's tokenizer, AMD EPYC fam 25 model 1: 1,000 / 4,000 / 16,000 choices in
    # 0.02 / 0.08 / 0.87 s; 100,000 took 51 s and then panicked, issue 36).
    max_structured_output_choices: int = setting(
        10_000, "most options in one structured-output choice list (more is a 400)", minimum=1)
    max_structured_output_bytes: int = setting(
        512 * 2**10, "largest structured-output constraint (JSON schema, regex, grammar or choice list, as "
        "canonical text), in bytes (more is a 400)", minimum=1)
    max_grammar_compile_s: float = setting(
        5.0, "seconds a request waits for its structured-output constraint to compile; past it a 400 "
        "(the compile, bounded by the grammar library's own work limits, finishes and is cached)", minimum=0.001)
    preprocess_timeout: float = setting(
        5.0, "seconds one request may hold a preprocessing thread; past it the work is abandoned "
        "between stages and the client gets 503", minimum=0.001)
    max_preprocess_queue: int = setting(
        64, "requests waiting for a preprocessing thread; beyond it a request gets 503", minimum=0)
    max_waiting_requests: int = setting(
        256, "requests waiting for preprocessing or for the engine; beyond it a request gets 503 "
        "with Retry-After", minimum=1)
    max_inflight_media_gb: float = setting(
        2.0, "decoded media held by requests in flight, GiB; beyond it a request gets 503", minimum=1e-6)
    warmup: bool = setting(True, "run one warm-up request before serving", negatable=True)
    log_request_stages: bool = setting(
        False, "log one line per request with its time to first token by stage (front end, preprocessing "
        "queue, render, fetch, decode, process, engine queue, encoder, prefill, ...); /metrics has them as "
        "vlmd_request_stage_seconds either way")
    # Tensor parallelism (vlmd/engine/executor.py, docs/architecture.md "Tensor parallelism").
    tensor_parallel_size: int = setting(
        1, "ranks the model is sharded over; >1 starts that many rank processes (gloo on CPU, NCCL on CUDA)",
        minimum=1)
    nnodes: int = setting(1, "hosts the tensor-parallel ranks span (ranks are split evenly between them)", minimum=1)
    node_rank: int = setting(0, "this host's index among --nnodes; only node 0 serves HTTP, the others run ranks only",
                             minimum=0)
    master_addr: str = setting("127.0.0.1", "address of node 0, where the ranks meet (torch.distributed TCP store)")
    master_port: int | None = setting(
        None, "port on node 0 where the ranks meet (default: a free port; required with --nnodes > 1)", minimum=1)
    distributed_timeout_s: float = setting(
        60.0, "a rank that does not answer a collective within this many seconds ends the server", minimum=1)
    # Encoder disaggregation (docs/encoder-wire-format.md): encoder servers compute items'
    # encoder outputs for language servers, keyed by the items' identifiers.
    encoder_only: bool = setting(
        False, "serve encoder outputs only: POST /v1/encoder_outputs fetches, decodes and processes media items "
        "under this server's bounds and answers their encoder outputs (safetensors bytes); the generation "
        "routes are off")
    encoder_urls: tuple[str, ...] | None = setting(
        None, "comma-separated base URLs of --encoder-only servers of the same model: each new media item's "
        "encoder output comes from one of them (the next on failure) instead of this server's encoder",
        parse=lambda text: parse_encoder_urls(text), metavar="URL,...")
    encoder_timeout_s: float = setting(
        10.0, "seconds one encoder server may take to answer (within --preprocess-timeout); slower is a failure "
        "and the next URL is tried", minimum=0.001)
    encoder_fallback: str = setting(
        "local", "when every --encoder-urls server failed: local (this server encodes the items itself) or fail "
        "(the request alone gets a 503 naming each server's failure)", choices=("local", "fail"))
    encoder_api_key: str | None = setting(
        None, "the API key the --encoder-urls servers require (their --api-key)", env="VLMD_ENCODER_API_KEY")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag of the first setting out of its range."""
        for spec in fields(self):
            minimum, maximum = spec.metadata.get("minimum"), spec.metadata.get("maximum")
            value = getattr(self, spec.name)
            flag = "--" + spec.name.replace("_", "-")
            if minimum is not None and value is not None and value < minimum:
                raise ValueError(f"{flag} must be at least {minimum}, got {value}")
            if maximum is not None and value is not None and value > maximum:
                raise ValueError(f"{flag} must be at most {maximum}, got {value}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} is not a multiple of --nnodes {self.nnodes}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be below --nnodes {self.nnodes}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("--nnodes > 1 needs --master-port (the port on node 0 every host connects to)")
        if self.encoder_only and self.encoder_urls:
            raise ValueError("--encoder-only and --encoder-urls exclude each other: an encoder server runs its own encoder")
        if self.encoder_only and self.tensor_parallel_size > 1:
            raise ValueError("--encoder-only runs one rank (its encoder is not sharded): drop --tensor-parallel-size")


def parse_encoder_urls(text: str) -> tuple[str, ...] | None:
    """``--encoder-urls``: http(s) base URLs (a trailing slash dropped), at least one."""
    urls = _comma_list(text)
    if urls is None:
        raise ValueError("--encoder-urls needs at least one URL")
    for url in urls:
        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https") or not rest.strip("/"):
            raise ValueError(f"--encoder-urls: {url!r} is not an http(s) URL such as http://10.0.0.5:8001")
    return tuple(url.rstrip("/") for url in urls)


def parse_device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (checked for existence when the engine starts)."""
    text = text.strip().lower()
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def resolve_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the argument itself when it is a template."""
    import jinja2

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as handle:
            text = handle.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"{value!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not parse: {exc.message} (line {exc.lineno})") from None
    return text


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """``image=2,video=1`` (vLLM also takes JSON: ``{"image": 2}``)."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        import json

        raw = json.loads(text)
        return {str(key): int(value) for key, value in raw.items()}
    limits: dict[str, int] = {}
    for part in text.split(","):
        modality, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(f"expected MODALITY=N in --limit-mm-per-prompt, got {part!r}")
        limits[modality.strip()] = int(value)
    return limits


# --media-io-kwargs '{"video": {...}}' keys -> MediaPolicy fields.
VIDEO_IO_FIELDS = {
    "num_frames": "video_num_frames",
    "fps": "video_fps",
    "max_frames": "max_video_frames",
    "max_duration_s": "max_video_duration_s",
    "max_bytes": "max_video_bytes",
    "max_decoded_bytes": "max_video_decoded_bytes",
}

# --media-io-kwargs '{"audio": {...}}' keys -> MediaPolicy fields (uploads to /v1/audio/*).
AUDIO_IO_FIELDS = {
    "max_bytes": "max_audio_bytes",
    "max_duration_s": "max_audio_duration_s",
    "max_decoded_bytes": "max_audio_decoded_bytes",
}
MEDIA_IO_FIELDS = {"video": VIDEO_IO_FIELDS, "audio": AUDIO_IO_FIELDS}


def parse_json_object(text: str, flag: str) -> dict:
    """A command-line JSON object such as --mm-processor-kwargs '{"max_pixels": 100352}'."""
    import json

    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


def media_policy_fields(media_io_kwargs: dict) -> dict:
    """MediaPolicy keyword arguments from --media-io-kwargs; unknown keys are an error."""
    fields = {}
    for modality, settings in media_io_kwargs.items():
        known = MEDIA_IO_FIELDS.get(modality)
        if known is None or not isinstance(settings, dict):
            raise ValueError(
                '--media-io-kwargs takes {"video": {...}, "audio": {...}} (no other modality has settings)'
            )
        if not settings:  # most likely a typo'd or half-written flag: say so instead of ignoring it
            raise ValueError(f"--media-io-kwargs {modality} names no settings; known: {sorted(known)}")
        for key, value in settings.items():
            if key not in known:
                raise ValueError(f"--media-io-kwargs {modality}.{key} is unknown; known: {sorted(known)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"--media-io-kwargs {modality}.{key} must be a number")
            fields[known[key]] = value
    return fields


def check_mm_limits(counts: dict[str, int], limits: dict[str, int]) -> None:
    for modality, count in counts.items():
        limit = limits.get(modality)
        if limit is not None and count > limit:
            raise BadRequestError(
                f"at most {limit} {modality}(s) may be provided in one prompt, got {count} "
                f"(server flag --limit-mm-per-prompt)"
            )
