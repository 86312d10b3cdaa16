"""Message dataclasses that cross layer boundaries (front end <-> engine <-> runner).

Plain data only (ints, lists, strings, numpy arrays): no torch, no asyncio, so the engine
could move to another process and these would only need a codec.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from vlmd.errors import BadRequestError

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, per request."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token only; k: plus top-k
    # Log-probs of the distribution after the logits processors (constraints, the model's
    # rule, bias, penalties, grammar) but before temperature: what openai-whisper and
    # transformers average for Whisper's avg_logprob. Default: the raw distribution.
    processed_logprobs: bool = False
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0 = off
    # Penalties on tokens already seen. OpenAI's presence/frequency penalties subtract
    # ``presence * (count > 0) + frequency * count`` over the output so far; transformers'
    # repetition penalty divides a positive logit (multiplies a negative one) for every
    # token of the prompt and the output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's ``logit_bias``: (token id, bias added to its logit), ids unique.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Token constraints from a generation config (HF ``suppress_tokens`` /
    # ``begin_suppress_tokens``): never sampled, or not as the first output token.
    suppress_token_ids: tuple[int, ...] = ()
    begin_suppress_token_ids: tuple[int, ...] = ()
    # When set, every sampled token is one of these (e.g. Whisper's language detection).
    allowed_token_ids: tuple[int, ...] | None = None
    # Structured output: a grammar compiled on the preprocessing pool
    # (vlmd.structured.compiler.CompiledGrammar); the runner masks every token with it.
    grammar: Any = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise BadRequestError("max_tokens must be at least 1", param="max_tokens")
        if self.temperature < 0:
            raise BadRequestError("temperature must be non-negative", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequestError("top_p must be in (0, 1]", param="top_p")
        if self.top_k < 0:
            raise BadRequestError("top_k must be 0 (disabled) or positive", param="top_k")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise BadRequestError("min_tokens must be between 0 and max_tokens", param="min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise BadRequestError("top_logprobs must be between 0 and 20", param="top_logprobs")
        if not 0.0 <= self.min_p <= 1.0:
            raise BadRequestError("min_p must be in [0, 1]", param="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise BadRequestError(f"{name} must be between -2 and 2", param=name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise BadRequestError("repetition_penalty must be in (0, 2]", param="repetition_penalty")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise BadRequestError("logit_bias values must be between -100 and 100", param="logit_bias")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise BadRequestError("allowed_token_ids must not be empty", param="allowed_token_ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class KVSpec:
    """The shape of a decoder's paged KV cache: per layer, K and V of kv_heads x head_dim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Each layer's sliding window in tokens (None: full attention), or empty: every layer is
    # full. The KV model groups windowed layers apart, keeping only their window's blocks
    # (vlmd/sched/kv_spec.py, docs/decisions.md D91, D95); the family's layers pass the same
    # window to the attention.
    layer_windows: tuple[int | None, ...] = ()
    # Cross-attention layers (an encoder-decoder's): their K/V, of the same kv_heads x head_dim,
    # are computed once per request from its encoder output and held in the blocks of their
    # KV group (docs/decisions.md D93, D95); not among ``num_layers``.
    num_cross_layers: int = 0
    # Each layer's recurrent state in bytes per request (a linear-attention layer's: its
    # convolution and delta-rule state, ``vlmd.layers.linear_attention.state``), None for an
    # attention layer; or empty: none has one. Such a layer keeps no K/V per token: its state
    # sits in the pages of its own KV group, a fixed number per request (D95, D105).
    layer_state_bytes: tuple[int | None, ...] = ()
    # Per layer, the earlier layer whose K/V it reads instead of keeping its own (None: its
    # own), or empty: every layer keeps its own. A sharing layer computes queries only and
    # holds nothing in the KV cache (``SharedKV``, docs/decisions.md D111); it must have its
    # source's window.
    layer_kv_sources: tuple[int | None, ...] = ()
    # Per layer, its head size where layers differ (Gemma 4: 512 on full-attention layers,
    # 256 on windowed ones), or empty: every layer's is ``head_dim``. A layer slot of the pool
    # holds the widest; a narrower layer uses the first values of each row (D111).
    layer_head_dims: tuple[int, ...] = ()
    # Per layer, its K/V heads where layers differ (Gemma 4's full layers with
    # attention_k_eq_v), or empty: every layer's is ``num_kv_heads``. A slot's rows hold the
    # widest layer's heads x head size (``slot_width``).
    layer_kv_heads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_state_bytes and len(self.layer_state_bytes) != self.num_layers:
            raise ValueError(f"{len(self.layer_state_bytes)} layer state sizes for {self.num_layers} layers")
        if any(size is not None and size < 1 for size in self.layer_state_bytes):
            raise ValueError(f"a recurrent state needs a size in bytes, got {self.layer_state_bytes}")
        if self.num_cross_layers < 0:
            raise ValueError(f"num_cross_layers must be >= 0, got {self.num_cross_layers}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if any(window is not None and window < 1 for window in self.layer_windows):
            raise ValueError(f"a sliding window must be >= 1 token, got {self.layer_windows}")
        if self.layer_head_dims and len(self.layer_head_dims) != self.num_layers:
            raise ValueError(f"{len(self.layer_head_dims)} layer head sizes for {self.num_layers} layers")
        if any(dim < 1 for dim in self.layer_head_dims):
            raise ValueError(f"a head size must be >= 1, got {self.layer_head_dims}")
        if self.layer_kv_heads and len(self.layer_kv_heads) != self.num_layers:
            raise ValueError(f"{len(self.layer_kv_heads)} layer K/V head counts for {self.num_layers} layers")
        if any(heads < 1 for heads in self.layer_kv_heads):
            raise ValueError(f"a layer needs K/V heads, got {self.layer_kv_heads}")
        if self.layer_kv_sources:
            if len(self.layer_kv_sources) != self.num_layers:
                raise ValueError(f"{len(self.layer_kv_sources)} K/V sources for {self.num_layers} layers")
            for layer, source in enumerate(self.layer_kv_sources):
                if source is None:
                    continue
                if not 0 <= source < layer or self.layer_kv_sources[source] is not None:
                    raise ValueError(f"layer {layer} reads the K/V of layer {source}, which is not an earlier "
                                     "layer with K/V of its own")
                windows = self.layer_windows or (None,) * self.num_layers
                if windows[layer] != windows[source] or self.head_dim_of(layer) != self.head_dim_of(source) \
                        or self.kv_heads_of(layer) != self.kv_heads_of(source):
                    raise ValueError(f"layer {layer} reads the K/V of layer {source}, whose window or head size "
                                     "differs from its own")

    def head_dim_of(self, layer: int) -> int:
        """Layer ``layer``'s head size (a cross-attention layer's is ``head_dim``)."""
        return self.layer_head_dims[layer] if self.layer_head_dims and layer < self.num_layers else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        """Layer ``layer``'s K/V heads (a cross-attention layer's are ``num_kv_heads``)."""
        return self.layer_kv_heads[layer] if self.layer_kv_heads and layer < self.num_layers else self.num_kv_heads

    @property
    def slot_width(self) -> int:
        """Values of K (or V) a layer slot's row holds: the widest layer's heads x head size."""
        layers = range(self.num_layers + self.num_cross_layers)
        return max(self.kv_heads_of(layer) * self.head_dim_of(layer) for layer in layers)

    @property
    def num_layers_with_kv(self) -> int:
        """Self-attention layers that keep K/V of their own per token: not a sharing layer
        (another layer's K/V), not a recurrent-state layer (a fixed state instead)."""
        return sum(1 for layer in range(self.num_layers)
                   if not (self.layer_kv_sources and self.layer_kv_sources[layer] is not None)
                   and not (self.layer_state_bytes and self.layer_state_bytes[layer] is not None))

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token in every self-attention layer that keeps its own (not a
        recurrent state, not another layer's K/V), at the pool's slot width (what the pool
        spends: a narrower layer's slot rows are as wide as the widest's)."""
        return 2 * self.num_layers_with_kv * self.slot_width * dtype_bytes

    def kv_cache_config(self, block_size: int, dtype_bytes: int, max_model_len: int, max_num_batched_tokens: int,
                        num_blocks: int | None = None):
        """The KV model of these layers (``vlmd/sched/kv_spec.py``): its groups over one pool of
        ``num_blocks`` pages (default: what one request of max_model_len holds at its most)."""
        from vlmd.sched.kv_spec import build_kv_cache_config, layer_kinds

        kinds = layer_kinds(self.num_layers, self.layer_windows, self.num_cross_layers, max_model_len,
                            layer_state_bytes=self.layer_state_bytes, layer_kv_sources=self.layer_kv_sources)
        slot = 2 * block_size * self.slot_width * dtype_bytes
        config = build_kv_cache_config(kinds, block_size, 1, slot)
        if num_blocks is None:
            num_blocks = sum(config.peak_request_blocks(max_model_len, max_num_batched_tokens))
        return config.with_blocks(num_blocks)


@dataclass
class MultiModalItem:
    """One image / video / audio clip after processing.

    ``identifier`` is a blake3 digest over model id, modality, content, size/mode and
    processor kwargs: it keys the processor, encoder and prefix caches. The item's
    placeholder run is ``prompt_token_ids[offset : offset + length]``; every placeholder
    receives one encoder output vector. ``encoder_inputs`` holds what the family's encoder
    needs (e.g. uint8 pixels), normalised later on the device.

    An encoder-decoder's input (Whisper's audio window) has no placeholders (``length`` 0):
    the decoder cross-attends to its encoder output from ``offset`` on. It is encoded when a
    chunk reaches ``offset`` and released once the request has computed past it (the runner
    keeps what it derived, e.g. cross-attention K/V). ``encoder_tokens`` is the size of its
    encoder output, which the encoder budget and cache count; it defaults to ``length``.

    ``encoder_output``: this item's encoder output as an encoder server sent it
    (``--encoder-urls``; a ``[num_encoder_tokens, width]`` tensor, docs/encoder-wire-format.md),
    or None. The scheduler budgets and caches the item as any other; the runner stores this
    output when the item is scheduled instead of running the encoder, and encodes
    ``encoder_inputs`` itself when it is None.
    """

    modality: str
    identifier: str
    offset: int
    length: int
    encoder_inputs: dict[str, Any] = field(default_factory=dict)
    encoder_tokens: int | None = None
    encoder_output: Any = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_encoder_tokens(self) -> int:
        return self.length if self.encoder_tokens is None else self.encoder_tokens

    @property
    def use_end(self) -> int:
        """First position that no longer needs the encoder output: the placeholders' end,
        or, for an item without placeholders, the position after its offset."""
        return max(self.end, self.offset + 1)


@dataclass
class EngineRequest:
    """A fully processed request, ready for the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mm_items: list[MultiModalItem] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    # perf_counter() when AsyncEngine.generate handed it to the engine: the start of its
    # engine stages (EngineTimings), on the clock every thread of the process shares.
    handed_time: float = 0.0
    # The family's own per-request object (processing/base.py ``family_state``): carried
    # unread through the scheduler to the runner, which hands it to the model.
    family_state: Any = None


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass
class EngineTimings:
    """Where one request's time went in the engine, up to its first token (perf_counter()
    stamps and seconds; given with its first token's delta). Between ``first_scheduled`` and
    ``first_token`` the request's prefill chunks ran (``chunk_seconds``: each step's, of which
    ``encoder_seconds`` the steps' encoder work, its own items' or others'); the rest of that
    span it waited while steps without it ran (its chunk did not fit the step's budget) or
    between steps."""

    handed: float = 0.0  # EngineRequest.handed_time
    first_scheduled: float = 0.0  # the start of the first step that scheduled it
    first_token: float = 0.0  # the end of the step that sampled its first token
    encoder_seconds: float = 0.0
    chunk_seconds: list[float] = field(default_factory=list)
    # vlmd.media.image.DECODED_PIXELS.begun at ``first_token``: the front end counts the image
    # decodes that ran whole before the loop took the token (PreprocessStages.pixels_waited).
    decoded_pixels_begun: int = 0


@dataclass
class RequestDelta:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # With FinishReason.ERROR: the HTTP status it means (vlmd.errors.ENGINE_REJECTED for a
    # request refused on arrival, ENGINE_FAILED for one whose step raised).
    error_status: int | None = None
    # On the delta of a request's first token: where its engine time went until then.
    timings: EngineTimings | None = None
