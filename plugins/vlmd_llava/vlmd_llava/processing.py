"""LLaVA-1.5 image processing: CLIP resize + center crop to uint8, 576 placeholders.

Mirrors transformers' CLIP image processor (PIL backend) up to the uint8 crop; rescale and
normalisation happen later on the device (see ``model.py``), fused with the cast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlmd.processing.base import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    ItemSize,
    ItemTokens,
    ProcessedItem,
)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def image_processor_config(model_dir: str) -> dict:
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = Path(model_dir) / name
        if path.exists():
            data = json.loads(path.read_text())
            return data.get("image_processor", data)
    return {}


class LlavaProcessingInfo(BaseProcessingInfo):
    def supported_mm_limits(self) -> dict[str, int | None]:
        return {"image": None}

    def marker_token_id(self, modality: str) -> int:
        return int(self.ctx.hf_config.image_token_index)

    def num_image_tokens(self) -> int:
        vision = self.ctx.hf_config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        strategy = getattr(self.ctx.hf_config, "vision_feature_select_strategy", "default")
        return patches if strategy == "default" else patches + 1

    def item_tokens(self, modality: str, size: ItemSize, kwargs: dict[str, Any]) -> ItemTokens:
        # Every image is resized and cropped to the tower's square: its size does not matter.
        count = self.num_image_tokens()
        return ItemTokens(replacement=count, placeholders=count, encoder_tokens=count)

    def image_settings(self) -> dict[str, Any]:
        raw = image_processor_config(self.ctx.model_dir)
        size = raw.get("size", {"shortest_edge": 336})
        crop = raw.get("crop_size", {"height": 336, "width": 336})
        return {
            "shortest_edge": int(size.get("shortest_edge", 336)) if isinstance(size, dict) else int(size),
            "crop": (int(crop["height"]), int(crop["width"])) if isinstance(crop, dict) else (int(crop), int(crop)),
            "resample": int(raw.get("resample", Image.BICUBIC)),
            "mean": tuple(raw.get("image_mean", CLIP_MEAN)),
            "std": tuple(raw.get("image_std", CLIP_STD)),
        }


class LlavaProcessor(BaseMultiModalProcessor):
    def __init__(self, info: LlavaProcessingInfo):
        super().__init__(info)
        self.settings = info.image_settings()
        self.image_token_id = info.marker_token_id("image")

    def process_item(self, modality: str, media: Image.Image, kwargs: dict[str, Any]) -> ProcessedItem:
        pixels = resize_and_crop(media, self.settings["shortest_edge"], self.settings["crop"], self.settings["resample"])
        tokens = self.info.item_tokens(modality, ItemSize(*media.size), kwargs)
        return ProcessedItem(
            encoder_inputs={"pixels": pixels},
            replacement=[self.image_token_id] * tokens.replacement,
        )


def resize_and_crop(image: Image.Image, shortest_edge: int, crop: tuple[int, int], resample: int) -> np.ndarray:
    """RGB uint8 ``[3, H, W]``: shortest side to ``shortest_edge``, then a center crop."""
    image = image.convert("RGB")
    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
    if (new_w, new_h) != (width, height):
        image = image.resize((new_w, new_h), resample=resample, reducing_gap=None)
    array = np.asarray(image)
    crop_h, crop_w = crop
    top = (new_h - crop_h) // 2
    left = (new_w - crop_w) // 2
    if top < 0 or left < 0:
        padded = np.zeros((max(new_h, crop_h), max(new_w, crop_w), 3), dtype=np.uint8)
        padded[max(-top, 0) : max(-top, 0) + new_h, max(-left, 0) : max(-left, 0) + new_w] = array
        array, top, left = padded, max(top, 0), max(left, 0)
    return np.ascontiguousarray(array[top : top + crop_h, left : left + crop_w].transpose(2, 0, 1))


class LlavaDummyInputsBuilder(BaseDummyInputsBuilder):
    def dummy_item(self, modality: str) -> Image.Image:
        # Every image becomes the same number of tokens; any size is the worst case.
        height, width = self.info.image_settings()["crop"]
        return Image.new("RGB", (width, height), color=(255, 255, 255))
