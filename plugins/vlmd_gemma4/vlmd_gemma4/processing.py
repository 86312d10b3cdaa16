"""Gemma 4's processing triple. Text only so far: the info offers no modality, so the
server refuses image, video and audio parts (400) and every prompt is text (issue 45: the
vision tower's token budget and audio come next)."""

from __future__ import annotations

from typing import Any

from vlmd.processing.base import BaseDummyInputsBuilder, BaseMultiModalProcessor, BaseProcessingInfo, ProcessedItem
from vlmd.types import KVSpec
from vlmd_gemma4 import layers as layer_facts


class Gemma4ProcessingInfo(BaseProcessingInfo):
    def supported_mm_limits(self) -> dict[str, int | None]:
        return {}

    def marker_token_id(self, modality: str) -> int:
        raise ValueError(f"this Gemma 4 takes no {modality} yet (text only)")

    def kv_spec(self) -> KVSpec:
        """Windows, head sizes and the layers that share K/V (``layers.kv_spec``): what
        `vlmd cost` and the memory plan count."""
        return layer_facts.kv_spec(self.ctx.hf_config.text_config)


class Gemma4Processor(BaseMultiModalProcessor):
    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        raise ValueError(f"this Gemma 4 takes no {modality} yet (text only)")


class Gemma4DummyInputsBuilder(BaseDummyInputsBuilder):
    def dummy_item(self, modality: str) -> Any:
        raise ValueError(f"this Gemma 4 takes no {modality} yet (text only)")
