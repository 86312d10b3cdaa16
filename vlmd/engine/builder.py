"""Start-up: from a checkpoint directory and a ServeConfig to a ready engine.

Finds the family for the checkpoint's architecture, measures the largest item per
modality with the family's dummy inputs, sizes the encoder budget and the KV cache,
and loads the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from vlmd.config import ServeConfig, media_policy_fields
from vlmd.engine.core import EngineCore
from vlmd.engine.executor import InProcessExecutor
from vlmd.engine.tp_startup import begin_tensor_parallel
from vlmd.errors import VlmdError
from vlmd.layers.linear import select_linear_kernels
from vlmd.media.policy import MediaPolicy
from vlmd.plugins.manager import build_registry
from vlmd.processing.base import ProcessingContext
from vlmd.processing.cache import ProcessorCache
from vlmd.processing.preprocess import InputPreprocessor
from vlmd.processing.speech import SpeechToTextProcessor
from vlmd.processing.transcription import TranscriptionPreprocessor
from vlmd.runner.kv_cache import num_blocks_for
from vlmd.runner.model_runner import ModelRunner
from vlmd.sched.scheduler import Scheduler, SchedulerConfig
from vlmd.structured.compiler import GrammarCompiler
from vlmd.testing.faults import install_from_env as install_fault_injection

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
    # Intra-op threads of the engine thread (rank 0's share of the cores under tensor parallelism).
    torch_threads: int | None = None


def text_config_of(hf_config):
    return getattr(hf_config, "text_config", None) or hf_config


def load_model(model_dir: str, dtype: torch.dtype, tp=None, hf_config=None):
    """The family's model for a checkpoint; ``tp`` (a ``TPGroup``) loads only that rank's shard."""
    from transformers import AutoConfig

    hf_config = hf_config or AutoConfig.from_pretrained(model_dir)
    family = build_registry().for_architectures(list(hf_config.architectures or []))
    loader = family.load("model").load
    model = loader(model_dir, hf_config, dtype) if tp is None or tp.size == 1 else loader(model_dir, hf_config, dtype, tp=tp)
    # Last, after the dtype cast: the chosen kernels may hold weights in a packed layout.
    kernels = select_linear_kernels(model)
    log.info("linear kernels", seconds=kernels["seconds"], shapes={k: v["chosen"] for k, v in kernels["shapes"].items()})
    install_fault_injection(model)  # a no-op unless a test set VLMD_FAULT_INJECTION (every rank alike)
    return model


def build_engine(config: ServeConfig, log_level: str = "info") -> BuiltEngine:
    from transformers import AutoConfig, AutoTokenizer

    started = time.perf_counter()
    model_dir = str(Path(config.model).expanduser())
    if config.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}")
    dtype = DTYPES[config.dtype]
    hf_config = AutoConfig.from_pretrained(model_dir)
    family = build_registry().for_architectures(list(hf_config.architectures or []))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if config.chat_template is not None:  # already the template's text (config.py:resolve_chat_template)
        tokenizer.chat_template = config.chat_template
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
    try:  # under the server-wide kwargs, which may raise an item's size
        largest = [
            processor.process_item(m, dummy.dummy_item(m), ctx.mm_processor_kwargs) for m in info.supported_mm_limits()
        ]
    except VlmdError as exc:
        raise ValueError(f"--mm-processor-kwargs: {exc.message}") from None
    max_item_tokens = max((_encoder_tokens(processed) for processed in largest), default=0)
    max_placeholders = max((_placeholders(processed) for processed in largest), default=0)
    if config.disable_chunked_mm_input and max_placeholders > config.max_num_batched_tokens:
        raise ValueError(
            f"--disable-chunked-mm-input needs --max-num-batched-tokens >= {max_placeholders} "
            f"(the largest item), got {config.max_num_batched_tokens}"
        )
    # Both default to the token budget and are raised to fit the largest item, so every
    # item can be scheduled at all.
    encoder_budget = max(config.max_num_encoder_input_tokens or config.max_num_batched_tokens, max_item_tokens)
    encoder_cache_size = max(config.encoder_cache_size or config.max_num_batched_tokens, max_item_tokens)

    # Tensor parallelism: the other ranks start first and load their shards meanwhile (they
    # die with this process if the start-up fails here: rank_process._die_with_parent).
    tensor_parallel = begin_tensor_parallel(config, model_dir, log_level) if config.tensor_parallel_size > 1 else None
    model = load_model(model_dir, dtype, tensor_parallel.tp if tensor_parallel else None, hf_config)
    enable_prefix_caching = config.enable_prefix_caching
    if enable_prefix_caching and getattr(model, "is_encoder_decoder", False):
        # Decoder K/V depend on the request's encoder input through cross-attention, and a
        # request's cross state is built in its first chunk: a prefix hit would skip both.
        log.info("prefix caching is off for an encoder-decoder model", family=family.name)
        enable_prefix_caching = False
    num_blocks = config.num_kv_blocks or num_blocks_for(model.kv_spec, config.block_size, dtype, config.kv_cache_gb * 2**30)
    if num_blocks * config.block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * config.block_size} tokens, less than max_model_len "
            f"{max_model_len}: raise --kv-cache-gb or lower --max-model-len"
        )
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=config.block_size,
        num_kv_blocks=num_blocks,
        max_num_encoder_input_tokens=encoder_budget,
        encoder_cache_size=encoder_cache_size,
        disable_chunked_mm_input=config.disable_chunked_mm_input,
        enable_prefix_caching=enable_prefix_caching,
    )
    runner = ModelRunner(model, num_blocks, config.block_size, dtype, seed=config.seed)
    if tensor_parallel is None:
        executor, torch_threads = InProcessExecutor(runner), config.torch_threads
    else:
        executor = tensor_parallel.executor(runner, num_blocks, config.block_size, config.seed)
        torch_threads = tensor_parallel.threads
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
        processor.cache = ProcessorCache(int(config.mm_processor_cache_gb * 2**30))
    transcriber = None
    if isinstance(processor, SpeechToTextProcessor):
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
        seconds=round(time.perf_counter() - started, 2),
    )
    return BuiltEngine(
        EngineCore(Scheduler(scheduler_config), executor), preprocessor, tokenizer, eos, max_model_len,
        scheduler_config, dummy, transcriber, grammar_compiler, torch_threads
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


def warm_up(built: BuiltEngine) -> None:
    """Run one small request per modality through the engine before serving.

    The first forward of each shape pays for lazy initialisation (kernels, allocator);
    paying it here keeps it out of the first client's latency.
    """
    from vlmd.types import EngineRequest, SamplingParams

    processor = built.preprocessor.processor
    info = processor.info
    text = built.tokenizer.encode("warm up", add_special_tokens=False)
    core = built.core
    # One request per modality: worst-case items of every modality together may not fit
    # max_model_len (a 32-frame video alone can be thousands of tokens).
    for modality in list(info.supported_mm_limits()) or [None]:
        media = {} if modality is None else {modality: [built.dummy_inputs.dummy_item(modality)]}
        prompt = text if modality is None else [info.marker_token_id(modality), *text]
        output = processor.apply(prompt, media)
        if len(output.prompt_token_ids) >= built.max_model_len:
            log.info("warm-up skips a modality whose largest item exceeds max_model_len", modality=modality)
            continue
        request = EngineRequest(
            f"warmup-{modality}", output.prompt_token_ids, SamplingParams(max_tokens=2), output.items,
            mrope_positions=output.mrope_positions, mrope_position_delta=output.mrope_position_delta,
        )
        core.add_request(request)
        while core.has_work():
            core.step()
