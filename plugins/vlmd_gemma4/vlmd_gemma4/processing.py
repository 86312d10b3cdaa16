"""Gemma 4 media processing: images, each resized (aspect ratio kept) to its token budget, uint8.

The chat template leaves the image soft token (``<|image|>``) per image; transformers'
processor replaces it with ``<|image>`` + n x ``<|image|>`` + ``<image|>``, n the image's
pooled patches (``settings.py``). The replacement here is those ids. Rescaling and
patchifying happen on the device (``model.py``). Audio is ``audio_processing.py``'s; video
is not taken yet (issue 45): its parts are refused (400).
"""

from __future__ import annotations

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
from vlmd.types import KVSpec
from vlmd_gemma4 import layers as layer_facts
from vlmd_gemma4.settings import ImageSettings, read_settings


class Gemma4ProcessingInfo(BaseProcessingInfo):
    def __init__(self, ctx):
        super().__init__(ctx)
        config = ctx.hf_config
        self.has_vision = config.vision_config is not None
        self.image_token_id = int(config.image_token_id)
        self.boi_token_id = int(config.boi_token_id)
        self.eoi_token_id = int(config.eoi_token_id)
        self.settings = read_settings(ctx.model_dir, config.vision_config) if self.has_vision else None

    def supported_mm_limits(self) -> dict[str, int | None]:
        return {"image": None} if self.has_vision else {}

    def marker_token_id(self, modality: str) -> int:
        return self.image_token_id

    def attends_within_items(self) -> bool:
        """Where an image's tokens see each other both ways (``use_bidirectional_attention=
        "vision"``): then each image is computed in one step."""
        return self.ctx.hf_config.text_config.use_bidirectional_attention == "vision"

    def kv_spec(self) -> KVSpec:
        """Windows, head sizes and the layers that share K/V (``layers.kv_spec``): what
        `vlmd cost` and the memory plan count."""
        return layer_facts.kv_spec(self.ctx.hf_config.text_config)

    def server_settings(self) -> ImageSettings:
        """The checkpoint's settings under the server's ``--mm-processor-kwargs``."""
        return self.settings.with_budget(self.ctx.mm_processor_kwargs)

    def request_settings(self, kwargs: dict[str, Any]) -> ImageSettings:
        """Under a request's kwargs (the server's merged with its own): at most the server's budget."""
        server = self.server_settings()
        return server.with_budget(kwargs, limit=server.max_soft_tokens)

    def item_tokens(self, modality: str, size: ItemSize, kwargs: dict[str, Any]) -> ItemTokens:
        """``<|image>``, the image's soft tokens, ``<image|>``."""
        settings = self.request_settings(kwargs)
        tokens = settings.soft_tokens(size.height, size.width)
        return ItemTokens(replacement=tokens + 2, placeholders=tokens, encoder_tokens=tokens,
                          layout={"max_soft_tokens": settings.max_soft_tokens})


class Gemma4Processor(BaseMultiModalProcessor):
    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        info: Gemma4ProcessingInfo = self.info
        settings = info.request_settings(kwargs)
        image = media.convert("RGB")
        height, width = settings.resized(image.height, image.width)
        if (width, height) != image.size:
            # As transformers' PIL backend: resize the uint8 image, no reducing_gap.
            image = image.resize((width, height), resample=settings.resample, reducing_gap=None)
        tokens = settings.soft_tokens(media.height, media.width)
        return ProcessedItem(
            encoder_inputs={"pixels": np.asarray(image, dtype=np.uint8), "patch_size": settings.patch_size},
            replacement=[info.boi_token_id, *[info.image_token_id] * tokens, info.eoi_token_id],
            placeholder_offset=1, num_placeholders=tokens,
        )


class Gemma4DummyInputsBuilder(BaseDummyInputsBuilder):
    """The most tokens an image can cost under the server's budget: of the sizes whose sides
    are whole pooling cells (a x b cells, a x b at most the budget), the one that costs most."""

    def dummy_item(self, modality: str) -> Any:
        settings = self.info.server_settings()
        cell = settings.pooling_kernel_size * settings.patch_size
        budget = settings.max_soft_tokens
        best = max(((settings.soft_tokens(a * cell, (budget // a) * cell), a) for a in range(1, budget + 1)))
        across = best[1]
        return Image.new("RGB", ((budget // across) * cell, across * cell), color=(255, 255, 255))
