"""Llama 3.2 Vision media processing: an image becomes uint8 tiles and an aspect-ratio id; the
prompt keeps its one ``<|image|>`` token per image (no expansion).

Tiles are cut with PIL exactly as transformers' ``MllamaImageProcessorPil`` cuts them
(``tiles.py``: the canvas, a bilinear resize of the uint8 image, black padding to the canvas,
row-major tiles); rescale and normalisation happen on the device (``vision.py``), so the
processor cache holds uint8 pixels.

The decoder never sees image embeddings in its token stream: its cross-attention layers read
K/V of every image of the request. Even a token before the first image reads them
(``layout.py``), so every image must be encoded before the request's first token is
computed. Each image is therefore an item *without placeholders at offset 0*, the way an
encoder-decoder's input is (the scheduler encodes them with the first chunk, the runner
derives the request's cross-attention K/V once from all of them), and the ``<|image|>``
tokens stay ordinary tokens of the prompt. Where each image's token sits, which decides what
each row attends to, travels as the family state (``CrossLayout``).
"""

from __future__ import annotations

import dataclasses
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
    ProcessorOutput,
)
from vlmd.types import KVSpec, MultiModalItem
from vlmd_mllama.layout import CrossLayout, build_layout
from vlmd_mllama.tiles import Canvas, canvas_for, read_tile_settings


class MllamaProcessingInfo(BaseProcessingInfo):
    def __init__(self, ctx):
        super().__init__(ctx)
        config = ctx.hf_config
        self.settings = read_tile_settings(ctx.model_dir, config)
        self.image_token_id = int(config.image_token_index)
        vision = config.vision_config
        # The tower's output per image: every tile it embeds (padding tiles too: a token
        # before the first image attends to them), each its patches plus a class token.
        self.max_tiles = int(vision.max_num_tiles)
        self.tokens_per_tile = (int(vision.image_size) // int(vision.patch_size)) ** 2 + 1

    def supported_mm_limits(self) -> dict[str, int | None]:
        return {"image": None}

    def marker_token_id(self, modality: str) -> int:
        return self.image_token_id

    def canvas(self, size: ItemSize, kwargs: dict[str, Any]) -> Canvas:
        if kwargs:
            raise BadRequestError(
                f"unknown mm_processor_kwargs {sorted(kwargs)}; Llama 3.2 Vision takes none (the tower's "
                "aspect-ratio embeddings fix max_image_tiles)",
                param="mm_processor_kwargs",
            )
        return canvas_for(size.height, size.width, self.settings)

    def item_tokens(self, modality: str, size: ItemSize, kwargs: dict[str, Any]) -> ItemTokens:
        """An image keeps its one ``<|image|>`` token; the tower makes ``max_tiles x
        tokens_per_tile`` vectors whatever its canvas (the real tiles and the padding)."""
        canvas = self.canvas(size, kwargs)
        layout = {"grid": f"{canvas.columns}x{canvas.rows}", "tiles": canvas.tiles,
                  "padding_tiles": self.max_tiles - canvas.tiles, "tokens_per_tile": self.tokens_per_tile}
        return ItemTokens(replacement=1, placeholders=0, encoder_tokens=self.max_tiles * self.tokens_per_tile,
                          layout=layout)

    def kv_spec(self) -> KVSpec:
        """The paged cache holds the self-attention layers; the cross-attention layers' K/V
        come from the images, into the cross pool's blocks (same heads and head size)."""
        text = self.ctx.hf_config.text_config
        heads = int(text.num_attention_heads)
        return KVSpec(num_layers=int(text.num_hidden_layers) - len(text.cross_attention_layers),
                      num_kv_heads=int(text.num_key_value_heads), head_dim=int(text.hidden_size) // heads,
                      num_cross_layers=len(text.cross_attention_layers))

    def cross_kv_tokens_per_item(self, modality: str) -> int:
        """Every tile the tower embeds for one image, padding tiles too (``decoder.py``)."""
        return self.max_tiles * self.tokens_per_tile


class MllamaProcessor(BaseMultiModalProcessor):
    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        if modality != "image":
            raise BadRequestError(f"Llama 3.2 Vision does not take {modality}")
        info: MllamaProcessingInfo = self.info
        canvas = info.canvas(ItemSize(media.width, media.height), kwargs)
        tiles = cut_tiles(media, canvas, info.settings.tile_size, info.settings.resample)
        return ProcessedItem(
            encoder_inputs={"tiles": tiles, "aspect_ratio_id": canvas.aspect_ratio_id},
            replacement=[info.image_token_id],
            num_placeholders=0,
            num_encoder_tokens=info.max_tiles * info.tokens_per_tile,
        )

    def family_state(self, prompt_token_ids: list[int], items: list[MultiModalItem]) -> CrossLayout | None:
        tiles = [int(item.encoder_inputs["tiles"].shape[0]) for item in items]
        return build_layout(prompt_token_ids, self.info.image_token_id, tiles)

    def apply(self, prompt_token_ids: list[int], media: dict[str, list[Any]],
              kwargs: dict[str, Any] | None = None) -> ProcessorOutput:
        """The base expansion (markers counted, items cached), then every image moved to
        offset 0: all of them are needed from the first token on (see the module docstring)."""
        output = super().apply(prompt_token_ids, media, kwargs)
        output.items = [dataclasses.replace(item, offset=0) for item in output.items]
        return output


def cut_tiles(image: Image.Image, canvas: Canvas, tile_size: int, resample: int) -> np.ndarray:
    """uint8 ``[tiles, 3, tile_size, tile_size]``: the image resized into its canvas (black
    below and right of it), row by row."""
    image = image.convert("RGB")
    if image.size != (canvas.width, canvas.height):
        # As transformers' PIL backend: resize the uint8 image, no reducing_gap.
        image = image.resize((canvas.width, canvas.height), resample=resample, reducing_gap=None)
    padded = np.zeros((canvas.rows * tile_size, canvas.columns * tile_size, 3), dtype=np.uint8)
    padded[: canvas.height, : canvas.width] = np.asarray(image)
    tiles = padded.reshape(canvas.rows, tile_size, canvas.columns, tile_size, 3).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(tiles.reshape(canvas.tiles, 3, tile_size, tile_size))


class MllamaDummyInputsBuilder(BaseDummyInputsBuilder):
    """Every image costs the tower the same (its maximum tiles); the dummy is one that
    fills them all, so the profile's encoder run is the real worst case too."""

    def dummy_item(self, modality: str) -> Any:
        info: MllamaProcessingInfo = self.info
        size = info.settings.tile_size
        return Image.new("RGB", (info.settings.max_image_tiles * size, size), color=(255, 255, 255))
