"""Qwen3-VL media processing: smart resize to uint8 pixels, grid_thw, placeholders, M-RoPE.

An image is resized by Qwen2-VL's code, as transformers' ``Qwen2VLImageProcessorPil`` (which
Qwen3-VL checkpoints name) does: bicubic, to the smart-resize size (``settings.py``), into
uint8 ``[1, 3, H, W]`` (one frame); rescale, normalisation and patchify happen later on the
device (``model.py``), so the processor cache holds uint8 pixels. Each 2x2 block of 16-px
patches is one placeholder. Qwen3-VL's own parts are its modalities (images), its encoder
rows (DeepStack) and its positions (``positions.py``).
"""

from __future__ import annotations

from typing import Any

from vlmd.errors import BadRequestError
from vlmd.processing.base import (
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    ItemSize,
    ItemTokens,
    ProcessedItem,
)
from vlmd.types import MultiModalItem
from vlmd_qwen2_vl.processing import Qwen2VLDummyInputsBuilder, grid_thw, resize_frames
from vlmd_qwen3_vl.positions import PositionTable, qwen3_vl_positions
from vlmd_qwen3_vl.settings import MODALITIES, VisionSettings, num_tokens, read_settings


class Qwen3VLProcessingInfo(BaseProcessingInfo):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.settings = {modality: read_settings(ctx.model_dir, modality) for modality in MODALITIES}
        self.merge_size = int(ctx.hf_config.vision_config.spatial_merge_size)

    def supported_mm_limits(self) -> dict[str, int | None]:
        return {modality: None for modality in MODALITIES}

    def marker_token_id(self, modality: str) -> int:
        config = self.ctx.hf_config
        return int(config.image_token_id if modality == "image" else config.video_token_id)

    def server_settings(self, modality: str) -> VisionSettings:
        """The checkpoint's settings under the server-wide --mm-processor-kwargs."""
        return self.settings[modality].with_kwargs(self.ctx.mm_processor_kwargs)

    def item_tokens(self, modality: str, size: ItemSize, kwargs: dict[str, Any]) -> ItemTokens:
        """An image smart-resized, its 2x2 patches merged into one token."""
        if modality not in self.settings:
            raise BadRequestError(f"Qwen3-VL here takes {', '.join(MODALITIES)}, not {modality}")
        count = num_tokens(size.height, size.width, self.settings[modality].with_kwargs(kwargs))
        return ItemTokens(replacement=count, placeholders=count, encoder_tokens=count)

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

    def family_state(self, prompt_token_ids: list[int], items: list[MultiModalItem]) -> PositionTable | None:
        if not items:
            return None  # text only: plain positions are M-RoPE's (p, p, p)
        placeholders = {self.info.marker_token_id(modality) for modality in MODALITIES}
        return PositionTable(*qwen3_vl_positions(prompt_token_ids, items, placeholders, self.info.merge_size))


class Qwen3VLDummyInputsBuilder(Qwen2VLDummyInputsBuilder):
    """The most tokens an image may have under the server's settings: Qwen2-VL's worst case,
    at Qwen3-VL's settings (its processing info serves images only)."""
