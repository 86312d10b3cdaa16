"""``vlmd cost MODEL_DIR``: what an image, a video or a clip costs, without loading weights.

Counts come from the family's own ``item_tokens`` (the processor takes its counts from the
same method) and the prompt from the server's own chat-template step, so the prompt tokens
printed here are the ``usage.prompt_tokens`` the server reports for the same request. KV
bytes come from the config's decoder shape, rounded up to whole blocks, per KV group of the
server's KV model (``vlmd/sched/kv_spec.py``): sliding-window layers count the blocks their
window holds (D91), an encoder-decoder's cross-attention layers the blocks of its encoder
tokens (D93), all from the one pool the server's memory plan sizes (D95).
"""

from __future__ import annotations

import numpy as np

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmd.config import DEFAULT_CPU_KV_CACHE_GB, media_policy_fields, serve_setting, setting_default
from vlmd.engine.memory_plan import (
    GIB, blocks_for_bytes, cross_items_per_request, cross_tokens_per_request, kv_budget_bytes,
)
from vlmd.processing.base import ItemSize, ProcessingContext
from vlmd.sched.block_pool import blocks_needed
from vlmd.sched.kv_spec import KVCacheConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # one per --dtype choice of serve's
# Serve's settings that mean the same here: their flags, defaults, help and choices are
# serve's (vlmd/config.py:ServeConfig), so the two commands cannot drift apart.
SHARED_SERVE_SETTINGS = ("mm_processor_kwargs", "media_io_kwargs", "dtype", "quantization", "block_size",
                         "max_model_len",
                         "kv_cache_gb", "num_kv_blocks", "max_num_batched_tokens", "encoder_cache_size",
                         "max_num_seqs", "limit_mm_per_prompt")
_IMAGE = re.compile(r"^(\d+)x(\d+)$")
_VIDEO = re.compile(r"^(\d+(?:\.\d+)?)(s?)x(\d+)x(\d+)$")


@dataclass(frozen=True)
class ItemSpec:
    modality: str
    label: str
    size: ItemSize
    source_frames: int = 0  # a video's frames before sampling
    source_fps: float | None = None  # its frame rate (sampling by rate needs it)


def parse_image(text: str) -> ItemSpec:
    match = _IMAGE.match(text.strip())
    if not match:
        raise ValueError(f"--image takes WIDTHxHEIGHT, e.g. 640x480, got {text!r}")
    width, height = int(match[1]), int(match[2])
    return ItemSpec("image", f"image {width}x{height}", ItemSize(width, height))


def parse_video(text: str, fps: float) -> ItemSpec:
    """``FRAMESxWxH`` (frames in the file) or ``SECONDSsxWxH`` (at ``fps``)."""
    match = _VIDEO.match(text.strip())
    if not match:
        raise ValueError(f"--video takes FRAMESxWIDTHxHEIGHT or SECONDSsxWIDTHxHEIGHT, e.g. 96x640x480, got {text!r}")
    amount, seconds, width, height = float(match[1]), bool(match[2]), int(match[3]), int(match[4])
    frames = round(amount * fps) if seconds else int(amount)
    if frames < 1:
        raise ValueError(f"--video {text!r} has no frames")
    label = f"video {match[1]}{'s' if seconds else ' frames'} {width}x{height}"
    return ItemSpec("video", label, ItemSize(width, height), source_frames=frames, source_fps=fps)


def audio_clip(seconds: float) -> ItemSpec:
    if not seconds > 0:
        raise ValueError("--audio-seconds must be positive")
    return ItemSpec("audio", f"audio {seconds:g}s", ItemSize(seconds=seconds))


def _serve_default(name: str):
    return setting_default(serve_setting(name))


@dataclass
class CostOptions:
    prompt: str = "Describe this."
    max_tokens: int = 0
    mm_processor_kwargs: dict = field(default_factory=lambda: _serve_default("mm_processor_kwargs"))
    media_io_kwargs: dict = field(default_factory=lambda: _serve_default("media_io_kwargs"))
    language: str | None = None
    timestamps: bool = False
    dtype: str = _serve_default("dtype")
    quantization: str = _serve_default("quantization")
    block_size: int = _serve_default("block_size")
    max_model_len: int | None = _serve_default("max_model_len")
    kv_cache_gb: float | None = _serve_default("kv_cache_gb")  # unset: as a CPU server, unless memory_gb is set
    num_kv_blocks: int | None = _serve_default("num_kv_blocks")
    memory_gb: float | None = None  # with memory_utilization: size the cache as the server would
    memory_utilization: float = 0.9
    activation_gb: float = 0.0  # the start-up profile's figure (logged by `vlmd serve`)
    max_num_batched_tokens: int = _serve_default("max_num_batched_tokens")
    encoder_cache_size: int | None = _serve_default("encoder_cache_size")
    max_num_seqs: int = _serve_default("max_num_seqs")
    limit_mm_per_prompt: dict = field(default_factory=lambda: _serve_default("limit_mm_per_prompt"))


def compute_cost(model_dir: str, items: list[ItemSpec], options: CostOptions) -> dict[str, Any]:
    from transformers import AutoConfig, AutoTokenizer

    from vlmd.media.policy import MediaPolicy
    from vlmd.plugins.manager import build_registry
    from vlmd.processing.preprocess import InputPreprocessor
    from vlmd.processing.speech import SpeechToTextProcessor

    if options.dtype not in _DTYPE_BYTES:
        raise ValueError(f"--dtype must be one of {sorted(_DTYPE_BYTES)}")
    if options.quantization != "none" and options.dtype != "float32":  # as serve refuses it
        raise ValueError(f"--quantization {options.quantization} needs --dtype float32")
    model_dir = str(Path(model_dir).expanduser())
    hf_config = AutoConfig.from_pretrained(model_dir)
    family = build_registry().for_architectures(list(hf_config.architectures or []))
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):  # a config-only directory: media and KV only, no text tokens
        tokenizer = None
    ctx = ProcessingContext(
        model_dir=model_dir, model_id=model_dir, hf_config=hf_config, tokenizer=tokenizer,
        mm_processor_kwargs=dict(options.mm_processor_kwargs), media_io_kwargs=dict(options.media_io_kwargs),
    )
    info = family.load("processing_info")(ctx)
    processor = family.load("processor")(info)
    policy = MediaPolicy(**media_policy_fields(options.media_io_kwargs))
    max_model_len = min(info.max_model_len(), options.max_model_len or info.max_model_len())

    served = set(info.supported_mm_limits())
    for spec in items:
        if spec.modality not in served:
            raise ValueError(f"this model takes no {spec.modality} (it takes: "
                             f"{', '.join(sorted(served)) or 'text only'})")
    rows, item_tokens = [], []
    for spec in items:
        size = spec.size
        if spec.modality == "video":  # the frames the decoder keeps, and their times
            kept = info.video_frame_indices(spec.source_frames, spec.source_fps, policy)
            times = tuple(index / spec.source_fps for index in kept) if spec.source_fps else ()
            size = ItemSize(size.width, size.height, len(kept), frame_times=times)
        label = spec.label
        if spec.modality == "audio" and isinstance(processor, SpeechToTextProcessor):
            size, label = ItemSize(seconds=min(size.seconds, processor.window_seconds)), label + " (per window)"
        tokens = info.item_tokens(spec.modality, size, ctx.mm_processor_kwargs)
        item_tokens.append(tokens)
        row = {"item": label, "modality": spec.modality, "prompt_tokens": tokens.replacement,
               "placeholder_tokens": tokens.placeholders, "encoder_tokens": tokens.encoder_tokens}
        if spec.modality == "video":
            row["frames"] = size.frames
        if tokens.layout:
            row["layout"] = dict(tokens.layout)
        rows.append(row)

    speech = isinstance(processor, SpeechToTextProcessor) and any(spec.modality == "audio" for spec in items)
    if speech:
        requests = _speech_requests(processor, items, options)
    elif tokenizer is None:
        prompt = sum(row["prompt_tokens"] for row in rows)
        requests = [{"request": "chat completion (media only: MODEL_DIR has no tokenizer)", "prompt_tokens": prompt}]
    else:
        preprocessor = InputPreprocessor(processor, policy, {}, max_model_len)
        parts = [{"type": f"{spec.modality}_url", f"{spec.modality}_url": {"url": "cost:"}} for spec in items]
        prompt_ids, _ = preprocessor.chat_prompt_ids([{"role": "user", "content": [*parts, {"type": "text", "text": options.prompt}]}])
        prompt = info.prompt_tokens(prompt_ids, item_tokens)
        requests = [{"request": "chat completion", "prompt_tokens": prompt}]

    spec = info.kv_spec()
    per_token = spec.bytes_per_token(_DTYPE_BYTES[options.dtype])
    # The server's KV model: its groups over one pool of pages (sched/kv_spec.py, D95).
    kv = spec.kv_cache_config(options.block_size, _DTYPE_BYTES[options.dtype], max_model_len,
                              options.max_num_batched_tokens)
    cross_kv = _cross_kv(options, info, items, kv)
    for request in requests:
        kv_tokens = request["prompt_tokens"] + options.max_tokens
        held = kv.request_blocks(kv_tokens, cross_kv["request_tokens"])
        request.update(kv_tokens=kv_tokens, kv_blocks=sum(held), kv_bytes=sum(held) * kv.page_bytes,
                       fits_max_model_len=request["prompt_tokens"] < max_model_len and kv_tokens <= max_model_len,
                       kv_groups=[{**group.describe(), "blocks": blocks} for group, blocks in zip(kv.groups, held)])
    cache = _cache(options, info, rows, kv, hf_config)
    sized = kv.with_blocks(max(1, cache["num_kv_blocks"]))
    most_blocks = max(request["kv_blocks"] for request in requests)
    # Requests of this size the pool holds at once, decoding, every group's blocks counted
    # (what /metrics shows the server running: vlmd_num_requests_running).
    cache["requests_held"] = cache["num_kv_blocks"] // most_blocks if most_blocks else 0
    cache["max_concurrency"] = round(sized.max_concurrency(max_model_len, cross_kv["max_request_tokens"]), 2)
    cache["full_length_requests"] = int(sized.max_concurrency(max_model_len, cross_kv["max_request_tokens"]))
    cache["layer_slots"] = kv.num_slots
    # Layers that read an earlier layer's K/V and hold none (D111): [layer, source] pairs.
    cache["shared_kv_layers"] = [[layer, source] for layer, source in enumerate(spec.layer_kv_sources)
                                 if source is not None]
    cache["block_bytes"] = kv.page_bytes
    return {
        "prompt_tokens": sum(r["prompt_tokens"] * r.get("windows", 1) for r in requests),
        "encoder_tokens": sum(row["encoder_tokens"] for row in rows) * max(r.get("windows", 1) for r in requests),
        "model": model_dir, "family": family.name, "dtype": options.dtype, "quantization": options.quantization,
        "block_size": options.block_size,
        "max_model_len": max_model_len, "kv_bytes_per_token": per_token, "max_tokens": options.max_tokens,
        "items": rows, "requests": requests, "cross_kv": cross_kv, "cache": cache,
    }


def _cross_kv(options: CostOptions, info, items: list[ItemSpec], kv: KVCacheConfig) -> dict:
    """Cross-attention K/V (an encoder-decoder's, D93): these items' tokens and blocks, and the
    most one request may bring; their blocks come from the one pool (D95)."""
    block = options.block_size
    limits = {m: count for m, count in options.limit_mm_per_prompt.items() if count != 0}
    supported = {m: limit for m, limit in info.supported_mm_limits().items() if options.limit_mm_per_prompt.get(m) != 0}
    counts = cross_items_per_request(supported, limits)
    most = cross_tokens_per_request(info, counts)
    tokens = sum(info.cross_kv_tokens_per_item(spec.modality) for spec in items)
    return {"request_tokens": tokens, "request_blocks": blocks_needed(tokens, block),
            "request_bytes": blocks_needed(tokens, block) * kv.page_bytes, "items_per_request": counts,
            "max_request_tokens": most, "max_request_bytes": blocks_needed(most, block) * kv.page_bytes}


def _speech_requests(processor, items: list[ItemSpec], options: CostOptions) -> list[dict]:
    """One decode per window of at most 30 s, plus language detection on a multilingual model
    without a language, as ``/v1/audio/*`` runs them. A cut falls at the quietest point of a
    window's last 5 s, so a clip of S seconds takes between ``windows`` and ``windows_max``."""
    from vlmd.processing.speech import TranscriptionOptions
    from vlmd.processing.transcription import QUIET_SEARCH_SECONDS

    if len(items) != 1 or items[0].modality != "audio":
        raise ValueError("a speech model takes one --audio-seconds clip and no other media")
    window, seconds = processor.window_seconds, items[0].size.seconds
    fewest = max(1, math.ceil(seconds / window))
    most = fewest if seconds <= window else 1 + math.ceil((seconds - window) / (window - QUIET_SEARCH_SECONDS))
    # The family's own speech prompt for a window of the clip's length (silence: the prompt's
    # length depends on the samples' count, never their values), so placeholders count too.
    samples = np.zeros(int(min(seconds, window) * processor.sampling_rate), dtype=np.float32)
    requests = []
    language = options.language
    if processor.multilingual and language is None:
        detection = processor.detection_prompt(samples)
        requests.append({"request": "language detection", "prompt_tokens": len(detection.prompt_token_ids),
                         "windows": 1})
        language = "en"  # any detected language: every language token is one token
    prompt = processor.speech_prompt(
        samples, TranscriptionOptions(language=language, timestamps=options.timestamps),
        language if processor.multilingual else None,
    )
    requests.append({"request": "transcription window", "prompt_tokens": len(prompt.prompt_token_ids),
                     "windows": fewest, "windows_max": most})
    probe = processor.no_speech_probe(prompt) if processor.temperature_fallback else None
    if probe is not None:  # with temperature 0 (the default) each window is also scored for silence
        requests.append({"request": "no-speech probe", "prompt_tokens": len(probe.prompt.prompt_token_ids),
                         "windows": fewest, "windows_max": most})
    return requests


def _cache(options: CostOptions, info, rows: list[dict], kv: KVCacheConfig, hf_config) -> dict:
    """The pool's blocks in the server's order (engine/sizing.py:plan_kv_cache): --num-kv-blocks,
    --kv-cache-gb, the memory plan (here --memory-gb), else a CPU server's default size; every
    KV group's blocks come from it."""
    def sized(source: str, blocks: int, **plan) -> dict:
        return {"source": source, **plan, "num_kv_blocks": blocks, "kv_bytes": blocks * kv.page_bytes}

    if options.num_kv_blocks is not None:
        return sized("num-kv-blocks", options.num_kv_blocks)
    if options.kv_cache_gb is not None or options.memory_gb is None:
        kv_cache_gb = DEFAULT_CPU_KV_CACHE_GB if options.kv_cache_gb is None else options.kv_cache_gb
        return sized("kv-cache-gb", blocks_for_bytes(kv_cache_gb * GIB, kv.page_bytes))
    weights = weight_bytes(info.ctx.model_dir, hf_config, options.dtype, options.quantization)
    largest = max((row["encoder_tokens"] for row in rows), default=0)
    encoder_tokens = max(options.encoder_cache_size or options.max_num_batched_tokens, largest)
    encoder_bytes = encoder_tokens * info.encoder_output_width() * _DTYPE_BYTES[options.dtype]
    activations = int(options.activation_gb * GIB)
    budget = kv_budget_bytes(int(options.memory_gb * GIB), options.memory_utilization, weights, activations,
                             encoder_bytes)
    return sized("utilization", blocks_for_bytes(budget, kv.page_bytes), memory_bytes=int(options.memory_gb * GIB),
                 utilization=options.memory_utilization, weight_bytes=weights, activation_bytes=activations,
                 encoder_cache_tokens=encoder_tokens, encoder_cache_bytes=encoder_bytes)


def weight_bytes(model_dir: str, hf_config, dtype: str, quantization: str = "none") -> int:
    """Bytes of the weights in ``dtype``: from the safetensors headers when the files are
    there, else from the family's model built on torch's meta device (no memory, no weights).
    ``quantization`` "int8": the decoder's linear layers and its LM head count as the server
    keeps them (int8 panels and a float32 scale per output channel, ``layers/linear/quantize.py``;
    a head tied to the embeddings adds its int8 copy to the float weight)."""
    return _dtype_weight_bytes(model_dir, hf_config, dtype) - _quantization_savings(hf_config, dtype, quantization)


def _quantization_savings(hf_config, dtype: str, quantization: str) -> int:
    """Bytes the quantized layers no longer hold: their float weights less their int8 panels."""
    if quantization == "none":
        return 0
    import torch

    from vlmd.layers.linear.quantize import int8_savings
    from vlmd.plugins.manager import build_registry

    family = build_registry().for_architectures(list(hf_config.architectures or []))
    with torch.device("meta"):
        model = family.load("model")(hf_config)
    return int8_savings(model, _DTYPE_BYTES[dtype])


def _dtype_weight_bytes(model_dir: str, hf_config, dtype: str) -> int:
    import json
    import struct

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if files:
        total = 0
        for path in files:
            with open(path, "rb") as handle:
                header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
            for name, entry in header.items():
                if name != "__metadata__":
                    total += math.prod(entry["shape"]) * _DTYPE_BYTES[dtype]
        return total
    import torch

    from vlmd.plugins.manager import build_registry

    family = build_registry().for_architectures(list(hf_config.architectures or []))
    with torch.device("meta"):
        model = family.load("model")(hf_config)
    return sum(p.numel() for p in model.parameters()) * _DTYPE_BYTES[dtype]


def format_table(report: dict[str, Any]) -> str:
    quantized = "" if report["quantization"] == "none" else f" weights, {report['quantization']} decoder and LM head"
    lines = [f"{report['model']} ({report['family']}, {report['dtype']}{quantized}, block {report['block_size']}, "
             f"max_model_len {report['max_model_len']}, {report['kv_bytes_per_token']} KV bytes/token)"]
    header = ("item", "prompt tokens", "placeholders", "encoder tokens")
    table = [header] + [(row["item"] + (f" ({row['frames']} frames kept)" if "frames" in row else "")
                         + (" (" + ", ".join(f"{k} {v}" for k, v in row["layout"].items()) + ")" if "layout" in row else ""),
                         str(row["prompt_tokens"]), str(row["placeholder_tokens"]), str(row["encoder_tokens"]))
                        for row in report["items"]]
    widths = [max(len(line[i]) for line in table) for i in range(4)]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in table]
    lines.append("")
    for request in report["requests"]:
        windows = ""
        if "windows" in request:
            most = request.get("windows_max", request["windows"])
            windows = f" x {request['windows']}" + (f"-{most}" if most != request["windows"] else "") + " windows"
        fits = "" if request["fits_max_model_len"] else "  (does NOT fit max_model_len)"
        groups = ""
        if len(request["kv_groups"]) > 1:
            groups = " (" + ", ".join(f"{_group_label(group)} {group['blocks']}" for group in request["kv_groups"]) + ")"
        lines.append(f"{request['request']}{windows}: {request['prompt_tokens']} prompt tokens, KV for "
                     f"{request['kv_tokens']} tokens = {request['kv_blocks']} blocks{groups} = "
                     f"{_size(request['kv_bytes'])}{fits}")
    cross = report["cross_kv"]
    if cross["max_request_bytes"]:
        held = ", ".join(f"{count} {modality}" for modality, count in cross["items_per_request"].items())
        lines.append(f"cross-attention K/V (held for a request's life, from the same pool): {cross['request_blocks']} "
                     f"blocks = {_size(cross['request_bytes'])} for these items; a request of {held} "
                     f"{_size(cross['max_request_bytes'])}")
    cache = report["cache"]
    lines.append(f"KV cache ({cache['source']}): {cache['num_kv_blocks']} blocks of {cache['layer_slots']} layer slots "
                 f"= {_size(cache['kv_bytes'])}; holds {cache['requests_held']} such requests; maximum concurrency "
                 f"for {report['max_model_len']} tokens per request: {cache['max_concurrency']}x")
    if cache["shared_kv_layers"]:
        pairs = ", ".join(f"{layer}<-{source}" for layer, source in cache["shared_kv_layers"])
        lines.append(f"  {len(cache['shared_kv_layers'])} layers read an earlier layer's K/V and hold none: {pairs}")
    if cache["source"] == "utilization":
        lines.append(f"  plan: {_size(cache['memory_bytes'])} x {cache['utilization']} - weights {_size(cache['weight_bytes'])}"
                     f" - activations {_size(cache['activation_bytes'])} - encoder cache {_size(cache['encoder_cache_bytes'])}"
                     f" ({cache['encoder_cache_tokens']} tokens)")
    return "\n".join(lines)


def _group_label(group: dict) -> str:
    if "window" in group:
        return f"{group['window']}-token window [group {group['group']}]"
    return f"{group['kind'].replace('_', ' ')} [group {group['group']}]"


def _size(count: int) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 2**20:.1f} MiB"


def add_parser(commands) -> None:
    """The ``vlmd cost`` subcommand's flags (serve's own, from ``ServeConfig``, where they mean the same)."""
    from vlmd.cli_flags import add_setting_flag

    cost = commands.add_parser("cost", help="tokens and KV memory of an image, video or clip (no weights loaded)")
    cost.add_argument("model", help="checkpoint directory (config and processor files are enough)")
    cost.add_argument("--image", action="append", default=[], help="WIDTHxHEIGHT, repeatable: items of one prompt")
    cost.add_argument("--video", action="append", default=[],
                      help="FRAMESxWIDTHxHEIGHT (frames in the file) or SECONDSsxWIDTHxHEIGHT, repeatable")
    cost.add_argument("--video-fps", type=float, default=30.0,
                      help="frame rate of a --video (turns SECONDSs into frames; sampling by rate reads it)")
    cost.add_argument("--audio-seconds", type=float, action="append", default=[], help="a clip's length")
    cost.add_argument("--prompt", default="Describe this.", help="the text of the user message")
    cost.add_argument("--max-tokens", type=int, default=0, help="output tokens to add to the KV figure")
    cost.add_argument("--language", help="speech: the clip's language (else a detection request is counted)")
    cost.add_argument("--timestamps", action="store_true", help="speech: segment timestamps")
    for name in SHARED_SERVE_SETTINGS:
        add_setting_flag(cost, serve_setting(name))
    cost.add_argument("--memory-gb", type=float, help="device memory: size the cache from a memory plan instead")
    cost.add_argument("--memory-utilization", type=float, default=0.9)
    cost.add_argument("--activation-gb", type=float, default=0.0,
                      help="activation peak to reserve (vlmd serve logs the measured one at start-up)")
    cost.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cost.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    return cost


def run(args) -> str:
    items = [parse_image(text) for text in args.image] + [parse_video(text, args.video_fps) for text in args.video]
    items += [audio_clip(seconds) for seconds in args.audio_seconds]
    options = CostOptions(
        prompt=args.prompt, max_tokens=args.max_tokens, language=args.language, timestamps=args.timestamps,
        mm_processor_kwargs=args.mm_processor_kwargs, media_io_kwargs=args.media_io_kwargs,
        dtype=args.dtype, quantization=args.quantization, block_size=args.block_size,
        max_model_len=args.max_model_len,
        kv_cache_gb=args.kv_cache_gb, num_kv_blocks=args.num_kv_blocks, memory_gb=args.memory_gb,
        memory_utilization=args.memory_utilization, activation_gb=args.activation_gb,
        max_num_batched_tokens=args.max_num_batched_tokens, encoder_cache_size=args.encoder_cache_size,
        max_num_seqs=args.max_num_seqs, limit_mm_per_prompt=args.limit_mm_per_prompt,
    )
    report = compute_cost(args.model, items, options)
    if args.json:
        import json

        return json.dumps(report, indent=2)
    return format_table(report)
