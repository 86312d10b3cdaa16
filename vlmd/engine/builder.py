"""Start-up: from a checkpoint directory and a ServeConfig to a ready engine.

Finds the family for the checkpoint's architecture, measures the largest item per
modality with the family's dummy inputs, sizes the encoder budget and the KV cache,
and loads the model.
"""

from __future__ import annotations

import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from vlmd.config import ServeConfig, media_policy_fields
from vlmd.engine.core import EngineCore
from vlmd.engine.executor import InProcessExecutor
from vlmd.engine.tp_startup import begin_tensor_parallel, pin_engine_thread
from vlmd.errors import VlmdError
from vlmd.layers.linear import select_linear_kernels
from vlmd.media.policy import MediaPolicy
from vlmd.models.base import check_model_capabilities
from vlmd.plugins.manager import build_registry
from vlmd.processing.base import ProcessingContext
from vlmd.processing.cache import ProcessorCache
from vlmd.processing.preprocess import InputPreprocessor
from vlmd.processing.speech import SpeechToTextProcessor
from vlmd.processing.transcription import TranscriptionPreprocessor
from vlmd.engine.memory_plan import MemoryPlan, cross_items_per_request, cross_tokens_per_request
from vlmd.engine.profile import profile_peak, unprofiled, worst_case_runs
from vlmd.host import last_level_cache_bytes
from vlmd.engine.sizing import check_items_fit, drop_unused_encoders, plan_kv_cache, weight_bytes_of
from vlmd.runner.device import make_current_on_this_thread, resolve_device
from vlmd.runner.model_runner import ModelRunner
from vlmd.sched.scheduler import Scheduler, SchedulerConfig
from vlmd.structured.compiler import GrammarCompiler

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BuiltEngine:
    core: EngineCore
    preprocessor: InputPreprocessor
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    scheduler_config: SchedulerConfig
    dummy_inputs: object
    # vlmd.processing.transcription.TranscriptionPreprocessor for speech-to-text families.
    transcriber: object = None
    grammar_compiler: GrammarCompiler | None = None
    memory_plan: MemoryPlan | None = None
    # Intra-op threads of the engine thread (rank 0's share of the cores under tensor parallelism).
    torch_threads: int | None = None


def text_config_of(hf_config):
    return getattr(hf_config, "text_config", None) or hf_config


def load_model(model_dir: str, dtype: torch.dtype, tp=None, hf_config=None, device: torch.device | None = None,
               before_device=None, linear_kernels: str = "auto", native_steps: bool = True,
               quantization: str = "none"):
    """The family's model for a checkpoint; ``tp`` (a ``TPGroup``) loads only that rank's shard.

    ``before_device(model)`` runs before the move to ``device`` (dropping unused encoders
    there saves their device memory); the linear kernels are chosen last, on the device.
    """
    from transformers import AutoConfig

    hf_config = hf_config or AutoConfig.from_pretrained(model_dir)
    family = build_registry().for_architectures(list(hf_config.architectures or []))
    loader = family.load("model").load
    model = loader(model_dir, hf_config, dtype) if tp is None or tp.size == 1 else loader(model_dir, hf_config, dtype, tp=tp)
    # What it offers beyond the required contract, checked before anything reads it.
    check_model_capabilities(family.name, model)
    if before_device is not None:
        before_device(model)
    if device is not None:
        model = model.to(device)
    # Last, after the dtype cast and the move: the chosen kernels (CPU only) may hold weights
    # in a packed layout.
    kernels = select_linear_kernels(model, linear_kernels, native_steps=native_steps, quantization=quantization)
    log.info("linear kernels", seconds=kernels["seconds"], shapes={k: v["chosen"] for k, v in kernels["shapes"].items()},
             native_buckets=kernels.get("native_buckets"), native_step_buckets=kernels.get("native_step_buckets"),
             pad_rows=kernels.get("pad_rows"),
             decode_products_ms=kernels.get("sequence_ms"))
    return model


def default_engine_threads(weight_bytes: int, device) -> int | None:
    """One intra-op thread for a model whose weights fit in half the last-level cache, else
    torch's default (None). Such a step is bound by per-op overhead, not bandwidth or FLOPs:
    a second OpenMP thread adds fork/join to every small op and takes a core from the event
    loop and the media threads. Measured (tiny LLaVA with head_dim 32, ~3 MB of weights, 2
    threads vs 1, 64 requests, AMD EPYC fam 25 model 17, two runs each, interleaved): c8 one
    image repeated 50.4/52.6 vs 79.0/65.8 req/s, c8 new images 35.9/36.0 vs 38.7/36.6.
    The small LLaVA (~380 MB) was slower on one thread (c8 repeated 6.5 vs 5.0 req/s)."""
    if device.type != "cpu":
        return None
    return 1 if weight_bytes <= last_level_cache_bytes() // 2 else None


def build_engine(config: ServeConfig, log_level: str = "info") -> BuiltEngine:
    from transformers import AutoConfig, AutoTokenizer

    started = time.perf_counter()
    # Tensor parallelism: this thread steps rank 0, pinned to its cores before its first torch
    # op (its OpenMP team inherits the pin); the other ranks start under the process's mask.
    pin = pin_engine_thread(config) if config.tensor_parallel_size > 1 else None
    model_dir = str(Path(config.model).expanduser())
    if config.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}")
    dtype = DTYPES[config.dtype]
    if config.quantization != "none" and (config.dtype != "float32" or config.tensor_parallel_size > 1):
        # Quantized from float32 weights, by one process: the ranks load their shards themselves.
        raise ValueError(f"--quantization {config.quantization} needs --dtype float32 and one process "
                         "(no --tensor-parallel-size)")
    hf_config = AutoConfig.from_pretrained(model_dir)
    family = build_registry().for_architectures(list(hf_config.architectures or []))
    # --chat-template (already the template's text: config.py:resolve_chat_template) replaces the checkpoint's.
    template = {} if config.chat_template is None else {"chat_template": config.chat_template}
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **template)
    text_config = text_config_of(hf_config)

    # Whisper's config names its decoder length max_target_positions.
    max_model_len = int(getattr(text_config, "max_position_embeddings", None) or text_config.max_target_positions)
    if config.max_model_len is not None:
        if config.max_model_len > max_model_len:
            raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's {max_model_len}")
        max_model_len = config.max_model_len

    ctx = ProcessingContext(
        model_dir=model_dir, model_id=config.model_name, hf_config=hf_config, tokenizer=tokenizer,
        mm_processor_kwargs=dict(config.mm_processor_kwargs), media_io_kwargs=dict(config.media_io_kwargs),
    )
    info = family.load("processing_info")(ctx)
    processor = family.load("processor")(info)
    dummy = family.load("dummy_inputs")(info)
    supported = info.supported_mm_limits()
    # A modality limited to 0 is never profiled, and its encoder is dropped before the model
    # goes to the device.
    modalities = [m for m in supported if config.limit_mm_per_prompt.get(m, 1) != 0]
    try:  # under the server-wide kwargs, which may raise an item's size
        largest = {m: processor.process_item(m, dummy.dummy_item(m), ctx.mm_processor_kwargs) for m in modalities}
    except VlmdError as exc:
        raise ValueError(f"--mm-processor-kwargs: {exc.message}") from None
    max_item_tokens = max((_encoder_tokens(processed) for processed in largest.values()), default=0)
    max_placeholders = max((_placeholders(processed) for processed in largest.values()), default=0)
    # Items go whole into one step server-wide, or because this family's items attend
    # within themselves both ways (a cut item could not be computed).
    keep_items_whole = config.disable_chunked_mm_input or info.attends_within_items()
    if keep_items_whole and max_placeholders > config.max_num_batched_tokens:
        why = "--disable-chunked-mm-input" if config.disable_chunked_mm_input else \
            f"{family.name} (its items attend within themselves both ways, so each goes in one step)"
        raise ValueError(
            f"{why} needs --max-num-batched-tokens >= {max_placeholders} "
            f"(the largest item), got {config.max_num_batched_tokens}"
        )
    check_items_fit(largest, max_model_len, config)
    # The cache defaults to the token budget, and both are raised to fit the largest item, so every
    # item can be scheduled at all (a budget set explicitly too small is an error above).
    encoder_cache_size = max(config.encoder_cache_size or config.max_num_batched_tokens, max_item_tokens)

    device = resolve_device(config.device)
    # The load, the profile and the warm-up run on this thread (vlmd serve's engine thread, which
    # then steps the engine): it works on cuda:N as its current device (a no-op on the CPU).
    make_current_on_this_thread(device)
    if device.type == "cuda" and dtype == torch.float32:
        # float32 means float32: TF32 matmuls and convolutions (cuDNN's default) would drift
        # from the CPU oracle after a few tokens.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # Tensor parallelism: the other ranks start first and load their shards meanwhile (they
    # die with this process if the start-up fails here: rank_process._die_with_parent).
    tensor_parallel = begin_tensor_parallel(config, model_dir, pin, log_level) if pin is not None else None
    dropped: list[str] = []
    text_only = info.accepts_text_only_prompts()
    model = load_model(
        model_dir, dtype, tensor_parallel.tp if tensor_parallel else None, hf_config, device,
        before_device=lambda loaded: dropped.extend(drop_unused_encoders(loaded, supported, modalities, text_only)),
        linear_kernels=config.linear_kernels,
        # The native decode step also needs the native attention (torch's keeps the modules).
        native_steps=config.attention_kernels != "torch", quantization=config.quantization,
    )
    # `vlmd cost` sizes caches from info.kv_spec() (a tensor-parallel rank holds its shard).
    if tensor_parallel is None and model.kv_spec != info.kv_spec():
        raise RuntimeError(f"{family.name}: the model's KV spec {model.kv_spec} differs from its processing "
                           f"info's {info.kv_spec()}")
    enable_prefix_caching = config.enable_prefix_caching
    capabilities = model.capabilities
    # The encoder work of a step defaults to one largest item, so a step that encodes stays
    # about one item long: a short request arriving meanwhile waits for that, not for every
    # image of a many-image request (D110). A decoder that cross-attends needs a chunk's
    # items together: its budget stays the token budget.
    default_encoder_budget = config.max_num_batched_tokens if capabilities.cross_attends else (
        max_item_tokens or config.max_num_batched_tokens)
    encoder_budget = max(config.max_num_encoder_input_tokens or default_encoder_budget, max_item_tokens)
    if enable_prefix_caching and capabilities.cross_attends and not capabilities.cross_attention_prefix_caching:
        # Decoder K/V depend on the request's encoder input through cross-attention. Block
        # hashes name it, and after a prefix hit the first chunk derives the cross state
        # again; a model opts in (``cross_attention_prefix_caching``) once that is tested for it.
        log.info("prefix caching is off for a model that cross-attends", family=family.name)
        enable_prefix_caching = False
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        # The KV model (sched/kv_spec.py) with the profile's blocks; the memory plan sizes it below.
        kv_cache=model.kv_spec.kv_cache_config(config.block_size, dtype.itemsize, max_model_len,
                                               config.max_num_batched_tokens),
        max_num_encoder_input_tokens=encoder_budget,
        encoder_cache_size=encoder_cache_size,
        disable_chunked_mm_input=keep_items_whole,
        enable_prefix_caching=enable_prefix_caching,
        short_prefill_tokens=config.short_prefill_tokens,
        long_prefill_step_tokens=config.long_prefill_step_tokens,
    )
    filler = (tokenizer.encode(" the", add_special_tokens=False) or [0])[0]
    if tensor_parallel is None:
        runs = worst_case_runs(processor, dummy, modalities, scheduler_config, filler, capabilities.cross_attends)
        profile = profile_peak(model, runs, scheduler_config, dtype, device, config.attention_kernels)
    else:  # a forward needs every rank's collectives: rank 0 cannot run one alone at start-up
        profile = unprofiled()
    width = processor.info.encoder_output_width()  # values in one cached encoder vector
    weight_bytes = weight_bytes_of(model)
    # The most cross-attention tokens one request brings (the items a prompt may carry, D93),
    # for the plan's full-length figures; its blocks come from the one pool like every group's.
    cross_tokens = cross_tokens_per_request(
        info, cross_items_per_request({m: supported[m] for m in modalities}, config.limit_mm_per_prompt))
    # A tensor-parallel rank's pages hold its shard of the heads (the model's spec is the shard's).
    plan = plan_kv_cache(config, device, profile, weight_bytes, scheduler_config.kv_cache,
                         encoder_cache_size * width * dtype.itemsize, max_model_len, cross_tokens)
    num_blocks = plan.num_kv_blocks
    scheduler_config = dataclasses.replace(scheduler_config, kv_cache=plan.kv_cache)
    runner = ModelRunner(model, plan.kv_cache, dtype, seed=config.seed, device=device,
                         attention_kernels=config.attention_kernels)
    if tensor_parallel is None:
        executor, torch_threads = InProcessExecutor(runner), config.torch_threads
        if torch_threads is None:
            torch_threads = default_engine_threads(weight_bytes, device)
    else:
        executor = tensor_parallel.executor(runner, plan.kv_cache, config.seed)
        torch_threads = tensor_parallel.pin.threads
    log.info("memory plan", **{k: v for k, v in plan.fields().items()}, profile_method=profile.method,
             profile_seconds=round(profile.seconds, 2), dropped_encoders=dropped or None)
    # Capacity as vLLM states it: requests of max_model_len tokens the pool holds at once,
    # every group's blocks counted (a window group's as it holds them decoding).
    log.info(f"maximum concurrency for {max_model_len} tokens per request: {plan.fields()['max_concurrency']}x",
             kv_blocks=num_blocks, kv_groups=plan.group_rows())
    policy = MediaPolicy(
        allowed_local_media_path=config.allowed_local_media_path,
        allow_private_urls=config.allow_private_media_urls,
        allowed_domains=config.allowed_media_domains,
        max_bytes=config.media_max_bytes,
        timeout_s=config.media_timeout_s,
        **media_policy_fields(config.media_io_kwargs),
    )
    preprocessor = InputPreprocessor(processor, policy, config.limit_mm_per_prompt, max_model_len)
    if config.mm_processor_cache_gb > 0:
        # Given to the family's processor (the plugin builds it from its info alone) only now:
        # the profile's worst-case items above must neither fill the cache nor count in its lookups.
        processor.cache = ProcessorCache(int(config.mm_processor_cache_gb * 2**30))
    transcriber = None
    # A speech-to-text processor serves /v1/audio/* unless audio is limited to 0 (its encoder dropped).
    if isinstance(processor, SpeechToTextProcessor) and "audio" in modalities:
        transcriber = TranscriptionPreprocessor(processor, policy, max_model_len)
    eos = _eos_token_ids(model_dir, tokenizer)
    # Structured outputs: for chat models with a fast tokenizer (llguidance reads its JSON).
    grammar_compiler = None
    if getattr(tokenizer, "is_fast", False) and getattr(tokenizer, "chat_template", None):
        grammar_compiler = GrammarCompiler(tokenizer, preprocessor.vocab_size, eos)
    log.info(
        "engine ready",
        family=family.name,
        kv_blocks=num_blocks,
        block_size=config.block_size,
        max_model_len=max_model_len,
        max_item_tokens=max_item_tokens,
        torch_threads=torch_threads or torch.get_num_threads(),
        seconds=round(time.perf_counter() - started, 2),
    )
    return BuiltEngine(
        EngineCore(Scheduler(scheduler_config), executor), preprocessor, tokenizer, eos, max_model_len,
        scheduler_config, dummy, transcriber, grammar_compiler, plan, torch_threads
    )


def _placeholders(processed) -> int:
    if processed.num_placeholders is not None:
        return processed.num_placeholders
    return len(processed.replacement) - processed.placeholder_offset


def _encoder_tokens(processed) -> int:
    """Encoder vectors of one processed item: one per placeholder unless it says otherwise."""
    if processed.num_encoder_tokens is not None:
        return processed.num_encoder_tokens
    return _placeholders(processed)


def _eos_token_ids(model_dir: str, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json (may be a list), else the tokenizer's."""
    import json

    path = Path(model_dir) / "generation_config.json"
    ids: list[int] = []
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return tuple(int(i) for i in ids)


class WarmUpFailed(ValueError):
    """The model could not run its own warm-up request: a start-up error, not a 500 per request."""


def warm_up(built: BuiltEngine) -> None:
    """Run one small request per modality through the engine before serving.

    The first forward of each shape pays for lazy initialisation (kernels, allocator);
    paying it here keeps it out of the first client's latency.
    """
    from vlmd.types import EngineRequest, FinishReason, SamplingParams

    processor = built.preprocessor.processor
    info = processor.info
    text = built.tokenizer.encode("warm up", add_special_tokens=False)
    core = built.core
    # One request per modality: worst-case items of every modality together may not fit
    # max_model_len (a 32-frame video alone can be thousands of tokens).
    enabled = [m for m in info.supported_mm_limits() if built.preprocessor.mm_limits.get(m) != 0]
    for modality in enabled or [None]:
        media = {} if modality is None else {modality: [built.dummy_inputs.dummy_item(modality)]}
        prompt = text if modality is None else [info.marker_token_id(modality), *text]
        output = processor.apply(prompt, media)
        if len(output.prompt_token_ids) >= built.max_model_len:
            log.info("warm-up skips a modality whose largest item exceeds max_model_len", modality=modality)
            continue
        request = EngineRequest(
            f"warmup-{modality}", output.prompt_token_ids, SamplingParams(max_tokens=2), output.items,
            family_state=output.family_state,
        )
        core.add_request(request)
        while core.has_work():
            deltas, _ = core.step()
            for delta in deltas:
                if delta.finish_reason is FinishReason.ERROR:
                    # Serving would answer every such request with a 500: refuse to start.
                    raise WarmUpFailed(
                        f"the warm-up request ({modality or 'text'}) failed: {delta.error}; the traceback "
                        "is logged above ('request failed in an engine step'); --no-warmup serves anyway")
