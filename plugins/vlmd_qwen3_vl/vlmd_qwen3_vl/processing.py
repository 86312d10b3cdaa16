"""Qwen3-VL media processing: smart resize to uint8 pixels, grid_thw, placeholders, M-RoPE.

An image is resized by Qwen2-VL's code, as transformers' ``Qwen2VLImageProcessorPil`` (which
Qwen3-VL checkpoints name) does: bicubic, to the smart-resize size (``settings.py``), into
uint8 ``[1, 3, H, W]`` (one frame); rescale, normalisation and patchify happen later on the
device (``model.py``), so the processor cache holds uint8 pixels. Each 2x2 block of 16-px
patches is one placeholder. Qwen3-VL's own parts are its video (frame pairs under their
timestamps, ``video.py``), its encoder rows (DeepStack) and its positions (``positions.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vlmd.errors import BadRequestError
from vlmd.processing.base import (
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    ItemSize,
    ItemTokens,
    ProcessedItem,
    ProcessorOutput,
)
from vlmd.media.video import resize_frames_chw
from vlmd.processing.frame_text import TimestampIds, with_first_timestamps_joined
from vlmd.processing.hashing import item_identifier
from vlmd.types import MultiModalItem
from vlmd_qwen2_vl.processing import Qwen2VLDummyInputsBuilder, grid_thw, resize_frames
from vlmd_qwen3_vl.positions import PositionTable, qwen3_vl_positions
from vlmd_qwen3_vl.settings import MODALITIES, VisionSettings, num_tokens, read_settings, read_video_rules
from vlmd_qwen3_vl.video import (
    DEFAULT_FPS,
    FrameLayout,
    capped_max_pixels,
    collapse_wrappers,
    frame_layout,
    frame_times,
    pair_times,
    smart_resize,
)

DEFAULT_NUM_FRAMES = 32  # vlmd.media.policy.MediaPolicy.video_num_frames


class Qwen3VLProcessingInfo(BaseProcessingInfo):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.settings = {modality: read_settings(ctx.model_dir, modality) for modality in MODALITIES}
        self.merge_size = int(ctx.hf_config.vision_config.spatial_merge_size)
        self.video_rules = read_video_rules(ctx.model_dir)
        config = ctx.hf_config
        self.vision_start_id, self.vision_end_id = int(config.vision_start_token_id), int(config.vision_end_token_id)
        # Each timestamp's ids, tokenized on its own (video.py), once per text.
        self.timestamp_ids = TimestampIds(ctx.tokenizer, "Qwen3-VL")

    def supported_mm_limits(self) -> dict[str, int | None]:
        return {modality: None for modality in MODALITIES}

    def marker_token_id(self, modality: str) -> int:
        config = self.ctx.hf_config
        return int(config.image_token_id if modality == "image" else config.video_token_id)

    def server_settings(self, modality: str) -> VisionSettings:
        """The checkpoint's settings under the server-wide --mm-processor-kwargs."""
        return self.settings[modality].with_kwargs(self.ctx.mm_processor_kwargs)

    def item_tokens(self, modality: str, size: ItemSize, kwargs: dict[str, Any]) -> ItemTokens:
        """An image smart-resized, its 2x2 patches merged into one token. A video: each frame
        pair's timestamp and bracketed placeholders, less the template's two brackets its
        expansion replaces (``video.py``); its span (placeholders and encoder rows) runs
        from the first pair's placeholders to the last's."""
        if modality not in self.settings:
            raise BadRequestError(f"Qwen3-VL here takes {', '.join(MODALITIES)}, not {modality}")
        if modality == "video":
            layout, pairs, per_pair, times = self.video_layout(size, kwargs)
            return ItemTokens(replacement=len(layout.replacement) - 2, placeholders=layout.span_length,
                              encoder_tokens=layout.span_length,
                              layout={"frames": size.frames, "frame_pairs": pairs, "tokens_per_pair": per_pair,
                                      "timestamps": [f"{time:.1f}" for time in times]})
        count = num_tokens(size.height, size.width, self.settings[modality].with_kwargs(kwargs))
        return ItemTokens(replacement=count, placeholders=count, encoder_tokens=count)

    def video_size(self, size: ItemSize, settings: VisionSettings) -> tuple[int, int]:
        """(height, width) of every frame of a video of ``size`` under ``settings``."""
        max_pixels = capped_max_pixels(size.frames, settings.min_pixels, settings.max_pixels, settings.factor,
                                       self.video_rules.max_video_tokens)
        return smart_resize(size.frames, size.height, size.width, settings.temporal_patch_size, settings.factor,
                            settings.min_pixels, max_pixels)

    def video_layout(self, size: ItemSize, kwargs: dict[str, Any]) -> tuple[FrameLayout, int, int, list[float]]:
        """(layout, frame pairs, placeholders per pair, pair times) of a video of ``size``;
        frames without times count as frames 0, 1, ... at 24 fps, as transformers counts
        bare frames."""
        settings = self.settings["video"].with_kwargs(kwargs)
        height, width = self.video_size(size, settings)
        times = size.frame_times or tuple(index / DEFAULT_FPS for index in range(size.frames))
        if len(times) != size.frames:
            raise ValueError(f"{len(times)} frame times for {size.frames} frames")
        pairs = -(-size.frames // settings.temporal_patch_size)
        per_pair = (height // settings.factor) * (width // settings.factor)
        times = pair_times(times, settings.temporal_patch_size)
        layout = frame_layout(self.timestamp_ids, times, per_pair, self.vision_start_id, self.vision_end_id,
                              self.marker_token_id("video"))
        return layout, pairs, per_pair, times

    def video_frame_indices(self, total: int, source_fps: float | None, policy) -> list[int]:
        """transformers' ``Qwen3VLVideoProcessor.sample_frames``: the server's fps
        (--media-io-kwargs), else the checkpoint's (2), frames per second of video (the
        source's rate, 24 when it names none), at least ``min_frames``, at most
        ``max_frames`` and the video's own, spread by a rounded linspace from the first frame
        to the last; and, vlmd's bound, at most the server's num_frames."""
        fps = policy.video_fps or self.video_rules.fps
        count = int(total / (source_fps or DEFAULT_FPS) * fps)
        count = min(max(count, self.video_rules.min_frames), self.video_rules.max_frames, total)
        count = min(count, policy.video_num_frames)
        return np.linspace(0, total - 1, count).round().astype(int).tolist()

    def video_num_frames(self) -> int:
        video = self.ctx.media_io_kwargs.get("video") or {}
        return int(video.get("num_frames", DEFAULT_NUM_FRAMES))

    def encoder_output_width(self) -> int:
        """Each placeholder's vector and one per DeepStack layer (``model.py``)."""
        config = self.ctx.hf_config
        return int(config.text_config.hidden_size) * (1 + len(config.vision_config.deepstack_visual_indexes))


class Qwen3VLProcessor(BaseMultiModalProcessor):
    def __init__(self, info: Qwen3VLProcessingInfo):
        super().__init__(info)
        # A request may narrow the server's pixel limits, never raise them (sized at start-up).
        self.ceiling = {modality: info.server_settings(modality).max_pixels for modality in MODALITIES}

    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        if modality not in MODALITIES:
            raise BadRequestError(f"Qwen3-VL here takes {', '.join(MODALITIES)}, not {modality}")
        settings = self.info.settings[modality].with_kwargs(kwargs)
        if settings.max_pixels > self.ceiling[modality]:
            raise BadRequestError(
                f"mm_processor_kwargs.max_pixels {settings.max_pixels} exceeds this server's {modality} "
                f"limit of {self.ceiling[modality]} pixels", param="mm_processor_kwargs",
            )
        if modality == "video":
            return self.process_video(media, settings, kwargs)
        width, height = media.size
        tokens = self.info.item_tokens(modality, ItemSize(width, height), kwargs)
        pixels = resize_frames([media], settings)
        grid = grid_thw(pixels.shape, settings)
        if grid[0] * grid[1] * grid[2] // settings.merge_size**2 != tokens.placeholders:
            # The encoder emits one vector per merged patch; a count from item_tokens that
            # disagreed with the pixels would misplace every embedding after this item.
            raise RuntimeError(f"{modality} grid {grid} does not give the {tokens.placeholders} tokens item_tokens says")
        return ProcessedItem(encoder_inputs={"pixels": pixels, "grid_thw": grid},
                             replacement=[self.info.marker_token_id(modality)] * tokens.replacement)

    def process_video(self, video: Any, settings: VisionSettings, kwargs: dict[str, Any]) -> ProcessedItem:
        frames = np.asarray(video)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
            raise BadRequestError("a video must decode to one or more RGB frames")
        size = ItemSize(frames.shape[2], frames.shape[1], len(frames), frame_times=frame_times(video))
        layout, pairs, per_pair, _ = self.info.video_layout(size, kwargs)
        height, width = self.info.video_size(size, settings)
        pixels = resize_frames_chw(frames, height, width, settings.resample)
        grid = grid_thw(pixels.shape, settings)
        if grid[0] != pairs or grid[1] * grid[2] // settings.merge_size**2 != per_pair:
            raise RuntimeError(f"video grid {grid} does not give the {pairs} x {per_pair} tokens the layout says")
        return ProcessedItem(
            encoder_inputs={"pixels": pixels, "grid_thw": grid,
                            "between": [np.asarray(ids, dtype=np.int64) for ids in layout.between]},
            replacement=list(layout.replacement),  # the layout may be cached: the item gets its own list
            placeholder_offset=layout.span_start,
            num_placeholders=layout.span_length,
        )

    def identifier(self, modality: str, media: Any, kwargs: dict[str, Any]) -> str:
        """A video's frame times are written into its prompt: the same frames at other times
        are another item (processor cache, encoder cache and prefix cache alike)."""
        if modality == "video":
            kwargs = {**kwargs, "frame_times": list(frame_times(media))}
        return item_identifier(self.info.ctx.model_id, modality, media, kwargs)

    def apply(self, prompt_token_ids: list[int], media: dict[str, list[Any]],
              kwargs: dict[str, Any] | None = None) -> ProcessorOutput:
        """Each video's expansion brackets its frame pairs itself, so the template's bracket
        pair around its marker goes first; its first timestamp is then tokenized with the
        text before it, as in transformers' whole prompt (``video.py``)."""
        if not media.get("video"):
            return super().apply(prompt_token_ids, media, kwargs)
        info = self.info
        prompt_token_ids = collapse_wrappers(prompt_token_ids, info.vision_start_id, info.marker_token_id("video"),
                                             info.vision_end_id)
        output = super().apply(prompt_token_ids, media, kwargs)
        temporal = info.settings["video"].temporal_patch_size
        return with_first_timestamps_joined(
            output, media["video"], lambda video: f"<{pair_times(frame_times(video), temporal)[0]:.1f} seconds>",
            info.ctx.tokenizer, self.family_state)

    def family_state(self, prompt_token_ids: list[int], items: list[MultiModalItem]) -> PositionTable | None:
        if not items:
            return None  # text only: plain positions are M-RoPE's (p, p, p)
        placeholders = {self.info.marker_token_id(modality) for modality in MODALITIES}
        return PositionTable(*qwen3_vl_positions(prompt_token_ids, items, placeholders, self.info.merge_size))


class Qwen3VLDummyInputsBuilder(Qwen2VLDummyInputsBuilder):
    """The most tokens an image may have under the server's settings: Qwen2-VL's worst case,
    at Qwen3-VL's settings. A video: the server's frame count (at least a pair) at the
    largest frames whose pixels all together stay within ``max_pixels``."""

    def dummy_item(self, modality: str) -> Any:
        if modality != "video":
            return super().dummy_item(modality)
        settings = self.info.server_settings("video")
        frames = max(2, self.info.video_num_frames())
        frames_counted = round(frames / settings.temporal_patch_size) * settings.temporal_patch_size
        cells = max(1, settings.max_pixels // (frames_counted * settings.factor**2))
        rows, cols = max(((r, min(cells // r, 200 * r)) for r in range(1, int(cells**0.5) + 1)),
                         key=lambda grid: (grid[0] * grid[1], grid[0]))
        return np.full((frames, rows * settings.factor, cols * settings.factor, 3), 255, dtype=np.uint8)
