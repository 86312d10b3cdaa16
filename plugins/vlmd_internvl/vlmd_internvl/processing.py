"""InternVL media processing: tiles (and a thumbnail) as uint8, and the placeholder run;
a video is one tile per frame under "FrameN:" labels (``video.py``).

The chat template writes ``<IMG_CONTEXT>`` for an image; it becomes ``<img>``, then
``tokens_per_tile`` ``<IMG_CONTEXT>`` placeholders per tile, then ``</img>``, as
transformers' ``InternVLProcessor`` writes it. Tiles are cut with PIL exactly as its
``GotOcr2ImageProcessorPil`` does (bicubic resize of the uint8 image to the grid, then crops;
the thumbnail is the whole image resized to one tile); rescale and normalisation happen later
on the device (``model.py``), so the processor cache holds uint8 pixels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from vlmd.errors import BadRequestError
from vlmd.media.video import resize_frames_chw
from vlmd.processing.base import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    ItemSize,
    ItemTokens,
    ProcessedItem,
)
from vlmd_internvl.settings import FrameSettings, read_frame_settings, read_tile_settings
from vlmd_internvl.tiling import TileGrid, TileSettings, tile_boxes
from vlmd_internvl.video import FrameLayout, frame_layout

DEFAULT_NUM_FRAMES = 32  # vlmd.media.policy.MediaPolicy.video_num_frames


class InternVLProcessingInfo(BaseProcessingInfo):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.settings = read_tile_settings(ctx.model_dir, ctx.hf_config)
        self.frames = read_frame_settings(ctx.model_dir, self.settings)
        tokenizer = ctx.tokenizer
        self.context_token_id = int(ctx.hf_config.image_token_id)
        # The run's brackets: the tokenizer names them (a config-only directory has none, and
        # then only counts are asked of it, which need no ids).
        self.start_token_id = _token_id(tokenizer, "<img>")
        self.end_token_id = _token_id(tokenizer, "</img>")
        # Video needs frames of the tile's size and the tokenizer's <video> marker.
        self.video_token_id = _token_id(tokenizer, "<video>", required=False)
        if tokenizer is not None and self.video_token_id is None:
            self.frames = None
        self._layouts: dict[int, FrameLayout] = {}

    def supported_mm_limits(self) -> dict[str, int | None]:
        return {"image": None} if self.frames is None else {"image": None, "video": None}

    def marker_token_id(self, modality: str) -> int:
        return self.video_token_id if modality == "video" else self.context_token_id

    def video_frames(self) -> FrameSettings:
        if self.frames is None:
            raise BadRequestError("this InternVL checkpoint takes no video (its frames are not tile-sized, or its "
                                  "tokenizer has no <video> marker)")
        return self.frames

    def frame_layout(self, num_frames: int) -> FrameLayout:
        """The labels and placeholders of a video of ``num_frames`` (tokenized once per count)."""
        self.video_frames()
        if num_frames not in self._layouts:
            self._layouts[num_frames] = frame_layout(self.ctx.tokenizer, num_frames, self.settings.tokens_per_tile,
                                                     "<IMG_CONTEXT>", "<img>", "</img>", self.context_token_id)
        return self._layouts[num_frames]

    def video_num_frames(self) -> int:
        video = self.ctx.media_io_kwargs.get("video") or {}
        return int(video.get("num_frames", DEFAULT_NUM_FRAMES))

    def server_settings(self) -> TileSettings:
        """The checkpoint's settings under the server-wide --mm-processor-kwargs."""
        return self.settings.with_kwargs(self.ctx.mm_processor_kwargs)

    def item_grid(self, size: ItemSize, kwargs: dict[str, Any]) -> TileGrid:
        return self.settings.with_kwargs(kwargs).grid(size.height, size.width)

    def item_tokens(self, modality: str, size: ItemSize, kwargs: dict[str, Any]) -> ItemTokens:
        """An image: ``<img>``, every tile's placeholders (the thumbnail's too), ``</img>``. A
        video: each frame's label and one tile; its encoder output spans the labels between."""
        if modality == "video":
            self.settings.with_kwargs(kwargs)  # the same kwargs are valid (they do not apply to frames)
            layout = self.frame_layout(size.frames)
            return ItemTokens(replacement=len(layout.replacement), placeholders=layout.span_length,
                              encoder_tokens=layout.span_length,
                              layout={"frames": size.frames, "tokens_per_frame": self.settings.tokens_per_tile})
        grid = self.item_grid(size, kwargs)
        count = grid.tiles * self.settings.tokens_per_tile
        layout = {"grid": f"{grid.columns}x{grid.rows}", "tiles": grid.columns * grid.rows,
                  "thumbnail": int(grid.thumbnail), "tokens_per_tile": self.settings.tokens_per_tile}
        return ItemTokens(replacement=count + 2, placeholders=count, encoder_tokens=count, layout=layout)


class InternVLProcessor(BaseMultiModalProcessor):
    def __init__(self, info: InternVLProcessingInfo):
        super().__init__(info)
        self.ceiling = info.server_settings().max_patches

    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        if modality == "video":
            return self.process_video(media, kwargs)
        if modality != "image":
            raise BadRequestError(f"InternVL does not take {modality}")
        settings = self.info.settings.with_kwargs(kwargs)
        if settings.max_patches > self.ceiling:
            raise BadRequestError(
                f"mm_processor_kwargs.max_patches {settings.max_patches} exceeds this server's limit of "
                f"{self.ceiling} tiles per image",
                param="mm_processor_kwargs",
            )
        width, height = media.size
        grid = settings.grid(height, width)
        tiles = cut_tiles(media, grid, settings)
        tokens = self.info.item_tokens(modality, ItemSize(width, height), kwargs)
        if len(tiles) * settings.tokens_per_tile != tokens.placeholders:
            # The tower emits tokens_per_tile vectors per tile; a count from item_tokens that
            # disagreed with the tiles would misplace every embedding after this item.
            raise RuntimeError(f"{len(tiles)} tiles do not give the {tokens.placeholders} tokens item_tokens says")
        info = self.info
        return ProcessedItem(
            encoder_inputs={"tiles": tiles},
            replacement=[info.start_token_id, *[info.context_token_id] * tokens.placeholders, info.end_token_id],
            placeholder_offset=1,
            num_placeholders=tokens.placeholders,
        )

    def process_video(self, video: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        self.info.settings.with_kwargs(kwargs)
        frames = self.info.video_frames()
        tiles = resize_frames_chw(video, frames.height, frames.width, frames.resample)
        layout = self.info.frame_layout(len(tiles))
        return ProcessedItem(
            encoder_inputs={"tiles": tiles, "between": [np.asarray(ids, dtype=np.int64) for ids in layout.between]},
            replacement=list(layout.replacement),  # the layout is shared between requests
            placeholder_offset=layout.span_start,
            num_placeholders=layout.span_length,
        )


def cut_tiles(image: Image.Image, grid: TileGrid, settings: TileSettings) -> np.ndarray:
    """uint8 ``[tiles, 3, tile_height, tile_width]``: the grid's tiles row by row, then the
    thumbnail when the grid has one."""
    image = image.convert("RGB")
    tile_h, tile_w = settings.tile_height, settings.tile_width
    canvas = _resized(image, grid.columns * tile_w, grid.rows * tile_h, settings.resample)
    tiles = [canvas[top:bottom, left:right] for left, top, right, bottom in tile_boxes(grid, tile_h, tile_w)]
    if grid.thumbnail:
        tiles.append(_resized(image, tile_w, tile_h, settings.resample))
    return np.ascontiguousarray(np.stack(tiles).transpose(0, 3, 1, 2))


def _resized(image: Image.Image, width: int, height: int, resample: int) -> np.ndarray:
    if image.size != (width, height):
        # As transformers' PIL backend: resize the uint8 image, no reducing_gap.
        image = image.resize((width, height), resample=resample, reducing_gap=None)
    return np.asarray(image)


def _token_id(tokenizer, token: str, required: bool = True) -> int | None:
    if tokenizer is None:
        return None
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        if required:
            raise ValueError(f"the InternVL tokenizer has no {token} token")
        return None
    return int(token_id)


class InternVLDummyInputsBuilder(BaseDummyInputsBuilder):
    """The costliest image under the server's settings: one whose grid is the most tiles
    (``max_patches`` in a row, with the thumbnail); a video of the server's frame count."""

    def dummy_item(self, modality: str) -> Any:
        if modality == "video":
            frames = self.info.video_frames()
            return np.full((max(1, self.info.video_num_frames()), frames.height, frames.width, 3), 255, dtype=np.uint8)
        settings = self.info.server_settings()
        columns = max(1, settings.max_patches)
        image = Image.new("RGB", (columns * settings.tile_width, settings.tile_height), color=(255, 255, 255))
        if settings.grid(image.height, image.width).tiles != settings.most_tiles():
            raise RuntimeError("the dummy image does not take the most tiles")
        return image
