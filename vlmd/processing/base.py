"""The three parts a model family provides for its media: info, processor, dummy inputs.

The processor's contract: given prompt token ids in which the chat template left one
marker token per media item, and the decoded media, return the prompt with each marker
expanded into that item's placeholder run, and one ``MultiModalItem`` per item (offset,
length, identifier, encoder inputs). Counts that do not match are a client error.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from vlmd.errors import BadRequestError
from vlmd.processing.embeds import SIZE_PROBES, ImageEmbeds, PrecomputedItem
from vlmd.processing.hashing import item_identifier
from vlmd.types import KVSpec, MultiModalItem


@dataclass
class ProcessingContext:
    model_dir: str
    model_id: str
    hf_config: Any
    tokenizer: Any
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    # Server-wide decode settings (--media-io-kwargs), e.g. {"video": {"num_frames": 32}}:
    # the dummy inputs need them to size the worst-case item.
    media_io_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProcessedItem:
    """One item after the family's preprocessing."""

    encoder_inputs: dict[str, Any]
    replacement: list[int]  # the tokens that replace the marker; placeholders are embeddings
    placeholder_offset: int = 0  # where the embedded run starts within ``replacement``
    num_placeholders: int | None = None  # defaults to len(replacement) - placeholder_offset
    # Vectors the encoder produces, when not one per placeholder (an encoder-decoder's input
    # has no placeholders: Whisper's 30 s window is 1,500 vectors).
    num_encoder_tokens: int | None = None


@dataclass(frozen=True)
class ItemSize:
    """What an item's cost depends on: pixels, frames kept after sampling, seconds of audio."""

    width: int = 0
    height: int = 0
    frames: int = 1  # a video's frames after the decoder's sampling; 1 for an image
    seconds: float = 0.0  # an audio window's length
    # A video's kept frames' times in the source (index / source rate, in seconds), for a
    # family whose prompt writes them (Qwen3-VL); empty when the caller has none.
    frame_times: tuple[float, ...] = ()


@dataclass(frozen=True)
class ItemTokens:
    """What one item costs in the prompt and in the encoder (see ``item_tokens``)."""

    replacement: int  # prompt tokens that replace the item's marker
    placeholders: int  # of those, the positions the encoder output fills
    encoder_tokens: int  # vectors the encoder produces (budgeted and cached)
    # How the family arrived at the count, for ``vlmd cost`` to show (a tiling family's grid,
    # tiles and thumbnail); empty when the count needs no explaining.
    layout: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass
class ProcessorOutput:
    prompt_token_ids: list[int]
    items: list[MultiModalItem]
    # What the family's model needs for this request beyond token ids and items (a position
    # table, ...): created by ``BaseMultiModalProcessor.family_state``, carried unread by
    # the core, handed back to the model (``MultimodalModel.slice_positions``).
    family_state: Any = None


class BaseProcessingInfo(ABC):
    """Facts about the family's media handling for one checkpoint."""

    def __init__(self, ctx: ProcessingContext):
        self.ctx = ctx

    @abstractmethod
    def supported_mm_limits(self) -> dict[str, int | None]:
        """Modalities this model accepts and the most items per prompt (None: no limit)."""

    @abstractmethod
    def marker_token_id(self, modality: str) -> int:
        """The token the chat template leaves in the prompt for each item."""

    def chat_part(self, modality: str) -> dict[str, Any]:
        """How one item appears in a message for this family's chat template."""
        return {"type": modality}

    def item_tokens(self, modality: str, size: ItemSize, kwargs: dict[str, Any]) -> ItemTokens:
        """What an item of ``size`` costs under ``kwargs`` (server-wide merged with the request's).

        The family's processor takes its counts from here too, so ``vlmd cost`` (which has
        only sizes, no pixels) and the server can never disagree.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement item_tokens")

    def prompt_tokens(self, prompt_token_ids: list[int], items: list[ItemTokens]) -> int:
        """The prompt's length once each item's marker in ``prompt_token_ids`` is replaced
        (``vlmd cost``; ``items`` in marker order): the markers' replacements added up, unless
        the family's processor also rewrites tokens beside a replacement (Gemma 3 joins
        newlines across its edges), when the family counts what its ``apply`` gives."""
        return len(prompt_token_ids) - len(items) + sum(item.replacement for item in items)

    def video_frame_indices(self, total: int, source_fps: float | None, policy) -> list[int]:
        """Which of a video's ``total`` frames the decoder keeps (``vlmd cost`` asks too): the
        media policy's count spread from the first frame (``vlmd.media.video``), unless the
        family samples as its reference processor does (Qwen3-VL)."""
        from vlmd.media.video import frames_to_keep, sample_frame_indices

        return sample_frame_indices(total, frames_to_keep(total, source_fps, policy))

    def attends_within_items(self) -> bool:
        """Whether an item's tokens attend to each other in both directions (some VLMs'
        images): then the scheduler keeps each item's tokens in one step, as
        ``--disable-chunked-mm-input`` does server-wide, since a chunk that cut the item
        could not compute it. The model gives the spans (``MultimodalModel.attention_spans``)."""
        return False

    def accepts_text_only_prompts(self) -> bool:
        """Whether a prompt may come without items. Not a speech-to-text model's (Whisper's
        decoder needs its audio in every request): it refuses a bare prompt at
        ``/v1/completions``, and its encoder cannot be disabled with ``--limit-mm-per-prompt``.
        (Whether the decoder cross-attends is the model's to declare, ``ModelCapabilities``.)"""
        return True

    def max_model_len(self) -> int:
        """The longest sequence the decoder takes (its position table)."""
        config = getattr(self.ctx.hf_config, "text_config", None) or self.ctx.hf_config
        return int(config.max_position_embeddings)

    def encoder_output_width(self) -> int:
        """Values in one vector of an item's encoder output, from the config alone: the
        decoder's hidden size unless the family's encoder emits more per placeholder (the
        encoder cache is sized by it, in ``vlmd serve`` and ``vlmd cost``)."""
        config = getattr(self.ctx.hf_config, "text_config", None) or self.ctx.hf_config
        return int(config.hidden_size)

    def cross_kv_tokens_per_item(self, modality: str) -> int:
        """Encoder tokens one item of ``modality`` adds to its request's cross-attention K/V
        (what ``prepare_cross_attention`` / ``prepare_request_cross_attention`` builds, held in
        the request's blocks of the cross pool), from the config alone; 0: the family has no
        cross-attention (``kv_spec().num_cross_layers`` is 0). It must equal the item's
        ``num_encoder_tokens``: the scheduler sizes a request's cross table from those."""
        return 0

    def kv_spec(self) -> KVSpec:
        """The decoder's paged-cache shape, from the checkpoint config alone (no weights).

        The default reads a decoder-only text config; an encoder-decoder family overrides it.
        The builder checks the loaded model's own spec against this one.
        """
        config = getattr(self.ctx.hf_config, "text_config", None) or self.ctx.hf_config
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        return KVSpec(
            num_layers=int(config.num_hidden_layers),
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
        )


class BaseMultiModalProcessor(ABC):
    def __init__(self, info: BaseProcessingInfo):
        self.info = info
        # Set by the engine builder: a vlmd.processing.cache.ProcessorCache (or None to
        # disable), and an observer with ``observe_process(modality, seconds)``.
        self.cache = None
        self.observer = None

    def _process_cached(self, modality: str, identifier: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        if self.cache is not None:
            cached = self.cache.get(identifier)
            if cached is not None:
                return cached
        started = time.perf_counter()
        processed = self.process_item(modality, media, kwargs)
        if self.observer is not None:
            self.observer.observe_process(modality, time.perf_counter() - started)
        if self.cache is not None:
            self.cache.put(identifier, processed)
        return processed

    @abstractmethod
    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        """Turn one decoded item into encoder inputs and its placeholder tokens."""

    def family_state(self, prompt_token_ids: list[int], items: list[MultiModalItem]) -> Any:
        """What this family's model needs for the request beyond its token ids and items
        (e.g. Qwen2-VL's 3-D position table), or None (the default): one object, created
        here once the placeholders are expanded, that the scheduler and runner carry
        without reading and the model consumes (``MultimodalModel.slice_positions``)."""
        return None

    def identifier(self, modality: str, media: Any, kwargs: dict[str, Any]) -> str:
        return item_identifier(self.info.ctx.model_id, modality, media, kwargs)

    def embeds_template(self, modality: str, kwargs: dict[str, Any]) -> ProcessedItem:
        """Where precomputed encoder output of ``modality`` goes in the prompt (an
        ``image_embeds`` part, vlmd/processing/embeds.py): the processed item of a blank
        image, without its encoder inputs. Only where that is where every image goes: the
        family's cost (``item_tokens``) is the same for a small and a large image, and the
        model has no cross-attention (whose K/V follow the image's tiles); else a 400."""
        info = self.info
        if modality != "image":
            raise BadRequestError(f"{modality} embeddings are not taken; image_embeds only", param="messages")
        refusal = f"the model `{info.ctx.model_id}` does not take image_embeds: "
        if info.cross_kv_tokens_per_item(modality):
            raise BadRequestError(refusal + "its cross-attention needs the image's tiles", param="messages")
        costs = {info.item_tokens(modality, ItemSize(width, height), kwargs) for width, height in SIZE_PROBES}
        if len(costs) != 1:
            raise BadRequestError(
                refusal + "where its images go in the prompt depends on each image's size, which embeddings do not "
                "carry (send the image)", param="messages")
        width, height = SIZE_PROBES[0]
        blank = self.process_item(modality, Image.new("RGB", (width, height), (255, 255, 255)), kwargs)
        return ProcessedItem(encoder_inputs={}, replacement=blank.replacement,
                             placeholder_offset=blank.placeholder_offset, num_placeholders=blank.num_placeholders,
                             num_encoder_tokens=blank.num_encoder_tokens)

    def _precomputed(self, modality: str, embeds: ImageEmbeds, kwargs: dict[str, Any]
                     ) -> tuple[str, ProcessedItem]:
        """The identifier and the prompt layout of an item given as its encoder output."""
        template = self.embeds_template(modality, kwargs)
        length = template.num_placeholders
        if length is None:
            length = len(template.replacement) - template.placeholder_offset
        expected = length if template.num_encoder_tokens is None else template.num_encoder_tokens
        if embeds.vectors.shape[0] != expected:
            raise BadRequestError(
                f"image_embeds hold {embeds.vectors.shape[0]} vectors; an image of the model "
                f"`{self.info.ctx.model_id}` takes {expected}", param="messages")
        identifier = item_identifier(self.info.ctx.model_id, modality, ("embeds", embeds.vectors.numpy()), kwargs)
        return identifier, template

    def apply(
        self, prompt_token_ids: list[int], media: dict[str, list[Any]], kwargs: dict[str, Any] | None = None
    ) -> ProcessorOutput:
        kwargs = {**self.info.ctx.mm_processor_kwargs, **(kwargs or {})}
        markers = {self.info.marker_token_id(modality): modality for modality in media}
        found: list[tuple[int, str]] = [
            (position, markers[token]) for position, token in enumerate(prompt_token_ids) if token in markers
        ]
        for modality, items in media.items():
            count = sum(1 for _, m in found if m == modality)
            if count != len(items):
                raise BadRequestError(
                    f"the prompt has {count} {modality} placeholder(s) but {len(items)} {modality} "
                    f"item(s) were given; do not type the model's {modality} marker in text"
                )
        next_index = {modality: 0 for modality in media}
        output: list[int] = []
        items_out: list[MultiModalItem] = []
        previous = 0
        for position, modality in found:
            output.extend(prompt_token_ids[previous:position])
            previous = position + 1
            data = media[modality][next_index[modality]]
            next_index[modality] += 1
            if isinstance(data, ImageEmbeds):  # its encoder output, not its media
                identifier, processed = self._precomputed(modality, data, kwargs)
            else:
                identifier = self.identifier(modality, data, kwargs)
                processed = self._process_cached(modality, identifier, data, kwargs)
            length = processed.num_placeholders
            if length is None:
                length = len(processed.replacement) - processed.placeholder_offset
            placed = dict(
                modality=modality,
                identifier=identifier,
                offset=len(output) + processed.placeholder_offset,
                length=length,
                encoder_inputs=processed.encoder_inputs,
                encoder_tokens=processed.num_encoder_tokens,
            )
            items_out.append(PrecomputedItem(**placed, precomputed=data.vectors) if isinstance(data, ImageEmbeds)
                             else MultiModalItem(**placed))
            output.extend(processed.replacement)
        output.extend(prompt_token_ids[previous:])
        return ProcessorOutput(output, items_out, self.family_state(output, items_out))


class BaseDummyInputsBuilder(ABC):
    """Worst-case items for start-up profiling (the most placeholders per item)."""

    def __init__(self, info: BaseProcessingInfo):
        self.info = info

    @abstractmethod
    def dummy_item(self, modality: str) -> Any:
        """An item of ``modality`` with the most placeholders this model can produce."""
