"""Qwen3-VL media processing: Qwen2-VL's image path at Qwen3-VL's patch size, and its own
M-RoPE table.

An image is resized with PIL exactly as transformers' ``Qwen2VLImageProcessorPil`` (which
Qwen3-VL checkpoints name) does, to multiples of 32 px; rescale, normalisation and patchify
happen on the device (``model.py``). Each 2x2 block of 16-px patches is one placeholder.
"""

from __future__ import annotations

from typing import Any

from vlmd.errors import BadRequestError
from vlmd.processing.base import BaseMultiModalProcessor
from vlmd.types import MultiModalItem
from vlmd_qwen2_vl.positions import MRopeState
from vlmd_qwen2_vl.processing import Qwen2VLDummyInputsBuilder, Qwen2VLProcessingInfo, Qwen2VLProcessor
from vlmd_qwen3_vl.positions import qwen3_vl_positions
from vlmd_qwen3_vl.settings import MODALITIES, read_qwen3_vl_settings


class Qwen3VLProcessingInfo(Qwen2VLProcessingInfo):
    def __init__(self, ctx):
        self.ctx = ctx
        self.settings = {modality: read_qwen3_vl_settings(ctx.model_dir, modality) for modality in MODALITIES}
        self.merge_size = int(ctx.hf_config.vision_config.spatial_merge_size)

    def supported_mm_limits(self) -> dict[str, int | None]:
        return {modality: None for modality in MODALITIES}

    def encoder_output_width(self) -> int:
        """Each placeholder's vector and one per DeepStack layer (``model.py``)."""
        config = self.ctx.hf_config
        return int(config.text_config.hidden_size) * (1 + len(config.vision_config.deepstack_visual_indexes))


class Qwen3VLProcessor(Qwen2VLProcessor):
    def __init__(self, info: Qwen3VLProcessingInfo):
        BaseMultiModalProcessor.__init__(self, info)
        # A request may narrow the server's pixel limits, never raise them (sized at start-up).
        self.ceiling = {modality: info.server_settings(modality).max_pixels for modality in MODALITIES}

    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]):
        if modality not in MODALITIES:
            raise BadRequestError(f"Qwen3-VL here takes {', '.join(MODALITIES)}, not {modality}")
        return super().process_item(modality, media, kwargs)

    def family_state(self, prompt_token_ids: list[int], items: list[MultiModalItem]) -> MRopeState | None:
        if not items:
            return None  # text only: plain positions are M-RoPE's (p, p, p)
        placeholders = {self.info.marker_token_id(modality) for modality in MODALITIES}
        return MRopeState(*qwen3_vl_positions(prompt_token_ids, items, placeholders, self.info.merge_size))


class Qwen3VLDummyInputsBuilder(Qwen2VLDummyInputsBuilder):
    """The most tokens an image may have under the server's settings."""
