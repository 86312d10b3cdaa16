"""Qwen2.5-VL media processing: Qwen2-VL's, plus absolute time for video.

Images and video frames are resized, paired and merged exactly as Qwen2-VL's (transformers'
Qwen2.5-VL processor uses Qwen2-VL's image and video processors), so the info, the processor
and the dummy inputs are Qwen2-VL's classes. What Qwen2.5-VL adds is time: a video's frame
pair ``t`` sits at M-RoPE time position ``int(t * tokens_per_second * second_per_grid_t)``,
where ``second_per_grid_t = temporal_patch_size / sampled_fps`` is the video time one frame
pair spans (transformers' ``Qwen2_5_VLProcessor._process_videos``). ``sampled_fps`` comes
from the decoder (``vlmd.media.video.VideoFrames``); frames without a rate count as 24 fps,
transformers' default for a video given as bare frames.

Text after an item resumes one past the item's largest position (``mrope_positions``), the
original Qwen2.5-VL rule and vLLM's. transformers 5.25 resumes it at ``start + max(h, w)``
instead, which differs after a video whose time span exceeds its merged height and width
(a 448x448 video sampled at 2 fps, from 9 s on): there vlmd follows the original.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vlmd.processing.base import ProcessedItem
from vlmd.processing.hashing import item_identifier
from vlmd.types import MultiModalItem
from vlmd_qwen2_vl.positions import MRopeState, mrope_positions
from vlmd_qwen2_vl.processing import Qwen2VLDummyInputsBuilder, Qwen2VLProcessingInfo, Qwen2VLProcessor

# transformers' VideoMetadata.sampled_fps when the frames come without a rate.
DEFAULT_SAMPLED_FPS = 24.0


def sampled_fps(video: Any) -> float:
    """Frames per second of video time the decoded frames stand for."""
    fps = getattr(video, "sampled_fps", None)
    return float(fps) if fps else DEFAULT_SAMPLED_FPS


class Qwen2_5_VLProcessingInfo(Qwen2VLProcessingInfo):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.tokens_per_second = float(ctx.hf_config.vision_config.tokens_per_second)

    def time_interval(self, second_per_grid_t: float) -> float:
        """M-RoPE time positions between consecutive frame pairs, rounded as transformers
        rounds it: ``tokens_per_second * second_per_grid_t`` in float32."""
        return float(np.float32(self.tokens_per_second) * np.float32(second_per_grid_t))


class Qwen2_5_VLProcessor(Qwen2VLProcessor):
    info: Qwen2_5_VLProcessingInfo

    def identifier(self, modality: str, media: Any, kwargs: dict[str, Any]) -> str:
        """A video's rate moves its positions: the same frames at another rate are another
        item (processor cache, encoder cache and prefix cache alike)."""
        if modality == "video":
            kwargs = {**kwargs, "sampled_fps": sampled_fps(media)}
        return item_identifier(self.info.ctx.model_id, modality, media, kwargs)

    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        processed = super().process_item(modality, media, kwargs)
        if modality == "video":
            temporal = self.info.settings["video"].temporal_patch_size
            processed.encoder_inputs["second_per_grid_t"] = temporal / sampled_fps(media)
        return processed

    def family_state(self, prompt_token_ids: list[int], items: list[MultiModalItem]) -> MRopeState | None:
        if not items:
            return None  # text only: plain positions are M-RoPE's (p, p, p)
        grids = [item.encoder_inputs["grid_thw"] for item in items]
        intervals = [
            self.info.time_interval(item.encoder_inputs["second_per_grid_t"]) if item.modality == "video" else 1.0
            for item in items
        ]
        table, delta = mrope_positions(len(prompt_token_ids), items, grids, self.info.merge_size, intervals)
        return MRopeState(table, delta)


class Qwen2_5_VLDummyInputsBuilder(Qwen2VLDummyInputsBuilder):
    """Qwen2-VL's worst cases: the same geometry gives the same largest items."""
