"""Qwen2-VL media processing: smart resize to uint8 frames, grid_thw, placeholders, M-RoPE.

An image is one frame, a video a stack of uniformly sampled frames (``vlmd.media.video``).
Each frame is resized with PIL exactly as transformers' ``Qwen2VLImageProcessorPil`` does
(bicubic, to the smart-resize size); rescale, normalisation and patchify happen later on the
device (``model.py``), so the processor cache holds uint8 pixels. Frames pair up along time
(temporal patch 2; an odd last frame is repeated), and every 2x2 block of 14-px patches of a
pair is one placeholder token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from vlmd.errors import BadRequestError
from vlmd.processing.base import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    ItemSize,
    ItemTokens,
    ProcessedItem,
)
from vlmd.types import MultiModalItem
from vlmd_qwen2_vl.positions import MRopeState, mrope_positions
from vlmd_qwen2_vl.settings import VisionSettings, num_tokens, read_settings, smart_resize

DEFAULT_NUM_FRAMES = 32  # vlmd.media.policy.MediaPolicy.video_num_frames


class Qwen2VLProcessingInfo(BaseProcessingInfo):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.settings = {modality: read_settings(ctx.model_dir, modality) for modality in ("image", "video")}
        self.merge_size = int(ctx.hf_config.vision_config.spatial_merge_size)

    def supported_mm_limits(self) -> dict[str, int | None]:
        return {"image": None, "video": None}

    def marker_token_id(self, modality: str) -> int:
        config = self.ctx.hf_config
        return int(config.image_token_id if modality == "image" else config.video_token_id)

    def server_settings(self, modality: str) -> VisionSettings:
        """The checkpoint's settings under the server-wide --mm-processor-kwargs."""
        return self.settings[modality].with_kwargs(self.ctx.mm_processor_kwargs)

    def item_tokens(self, modality: str, size: ItemSize, kwargs: dict[str, Any]) -> ItemTokens:
        """An image, or a video of ``size.frames`` kept frames: smart-resized, frames paired,
        2x2 patches merged into one token."""
        settings = self.settings[modality].with_kwargs(kwargs)
        frames = 1 if modality == "image" else size.frames
        count = num_tokens(size.height, size.width, settings, frames)
        return ItemTokens(replacement=count, placeholders=count, encoder_tokens=count)

    def video_num_frames(self) -> int:
        video = self.ctx.media_io_kwargs.get("video") or {}
        return int(video.get("num_frames", DEFAULT_NUM_FRAMES))


class Qwen2VLProcessor(BaseMultiModalProcessor):
    def __init__(self, info: Qwen2VLProcessingInfo):
        super().__init__(info)
        self.ceiling = {modality: info.server_settings(modality).max_pixels for modality in ("image", "video")}

    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        settings = self.info.settings[modality].with_kwargs(kwargs)
        if settings.max_pixels > self.ceiling[modality]:
            raise BadRequestError(
                f"mm_processor_kwargs.max_pixels {settings.max_pixels} exceeds this server's {modality} "
                f"limit of {self.ceiling[modality]} pixels",
                param="mm_processor_kwargs",
            )
        frames = [media] if modality == "image" else [Image.fromarray(frame) for frame in _frames_of(media)]
        width, height = frames[0].size
        tokens = self.info.item_tokens(modality, ItemSize(width, height, len(frames)), kwargs)
        pixels = resize_frames(frames, settings)
        grid = grid_thw(pixels.shape, settings)
        if grid[0] * grid[1] * grid[2] // settings.merge_size**2 != tokens.placeholders:
            # The encoder emits one vector per merged patch; a count from item_tokens that
            # disagreed with the pixels would misplace every embedding after this item.
            raise RuntimeError(f"{modality} grid {grid} does not give the {tokens.placeholders} tokens item_tokens says")
        return ProcessedItem(
            encoder_inputs={"pixels": pixels, "grid_thw": grid},
            replacement=[self.info.marker_token_id(modality)] * tokens.replacement,
        )

    def family_state(self, prompt_token_ids: list[int], items: list[MultiModalItem]) -> MRopeState | None:
        if not items:
            return None  # text only: plain positions are M-RoPE's (p, p, p)
        grids = [item.encoder_inputs["grid_thw"] for item in items]
        return MRopeState(*mrope_positions(len(prompt_token_ids), items, grids, self.info.merge_size))


def resize_frames(frames: list[Image.Image], settings: VisionSettings) -> np.ndarray:
    """uint8 ``[frames, 3, H, W]``, each frame resized to the smart-resize size of the first."""
    width, height = frames[0].size
    new_h, new_w = smart_resize(height, width, settings.factor, settings.min_pixels, settings.max_pixels)
    out = np.empty((len(frames), 3, new_h, new_w), dtype=np.uint8)
    for index, frame in enumerate(frames):
        frame = frame.convert("RGB")
        if frame.size != (new_w, new_h):
            # As transformers' PIL backend: resize the uint8 image, no reducing_gap.
            frame = frame.resize((new_w, new_h), resample=settings.resample, reducing_gap=None)
        out[index] = np.asarray(frame).transpose(2, 0, 1)
    return out


def grid_thw(shape: tuple[int, ...], settings: VisionSettings) -> tuple[int, int, int]:
    """(temporal, height, width) patch counts of ``[frames, 3, H, W]`` pixels."""
    frames, _, height, width = shape
    temporal = -(-frames // settings.temporal_patch_size)  # an odd last frame is repeated
    return temporal, height // settings.patch_size, width // settings.patch_size


def _frames_of(video: Any) -> np.ndarray:
    frames = np.asarray(video)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise BadRequestError("a video must decode to one or more RGB frames")
    return frames


class Qwen2VLDummyInputsBuilder(BaseDummyInputsBuilder):
    """Worst cases under the server's settings: the most tokens per image, and a video of the
    server's frame count at the most tokens per frame."""

    def dummy_item(self, modality: str) -> Any:
        settings = self.info.server_settings(modality)
        rows, cols = _largest_grid(settings.max_pixels // settings.factor**2)
        height, width = rows * settings.factor, cols * settings.factor
        if modality == "image":
            return Image.new("RGB", (width, height), color=(255, 255, 255))
        return np.full((max(1, self.info.video_num_frames()), height, width, 3), 255, dtype=np.uint8)


def _largest_grid(cells: int, max_ratio: int = 200) -> tuple[int, int]:
    """(rows, cols) with rows * cols <= cells as large as possible, closest to square."""
    best = (1, 1)
    for rows in range(1, int(cells**0.5) + 1):
        cols = min(cells // rows, rows * max_ratio)
        if rows * cols > best[0] * best[1]:
            best = (rows, cols)
    return best
