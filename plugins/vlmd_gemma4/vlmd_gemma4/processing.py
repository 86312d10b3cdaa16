"""Gemma 4 media processing: images, each resized (aspect ratio kept) to its token budget, uint8;
videos, their frames under their timestamps (``video.py``).

The chat template leaves the image soft token (``<|image|>``) per image; transformers'
processor replaces it with ``<|image>`` + n x ``<|image|>`` + ``<image|>``, n the image's
pooled patches (``settings.py``). The replacement here is those ids. A video's marker
(``<|video|>``) becomes each frame's ``mm:ss`` and its soft tokens in the same brackets.
Rescaling and patchifying happen on the device (``model.py``). Audio is
``audio_processing.py``'s.
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
    ProcessorOutput,
)
from vlmd.processing.frame_text import DEFAULT_FPS, TimestampIds, frame_times, with_first_timestamps_joined
from vlmd.processing.hashing import item_identifier
from vlmd.types import KVSpec
from vlmd_gemma4 import layers as layer_facts
from vlmd_gemma4.settings import ImageSettings, read_settings
from vlmd_gemma4.video import (
    FrameLayout,
    VideoSettings,
    frame_layout,
    read_video_settings,
    resize_frames,
    sample_frame_indices,
    timestamp,
    with_frames,
)


class Gemma4ProcessingInfo(BaseProcessingInfo):
    def __init__(self, ctx):
        super().__init__(ctx)
        config = ctx.hf_config
        self.has_vision = config.vision_config is not None
        self.image_token_id = int(config.image_token_id)
        self.boi_token_id = int(config.boi_token_id)
        self.eoi_token_id = int(config.eoi_token_id)
        self.video_token_id = int(config.video_token_id)
        self.settings = read_settings(ctx.model_dir, config.vision_config) if self.has_vision else None
        video_frames = (ctx.media_io_kwargs.get("video") or {}).get("num_frames")
        self.video_settings: VideoSettings | None = (
            with_frames(read_video_settings(ctx.model_dir, config.vision_config), video_frames)
            if self.has_vision else None)
        # Each timestamp's ids, tokenized on its own (video.py), once per text.
        self.timestamp_ids = TimestampIds(ctx.tokenizer, "Gemma 4")

    def supported_mm_limits(self) -> dict[str, int | None]:
        return {"image": None, "video": None} if self.has_vision else {}

    def marker_token_id(self, modality: str) -> int:
        return self.video_token_id if modality == "video" else self.image_token_id

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
        """``<|image>``, the image's soft tokens, ``<image|>``. A video: each frame's timestamp
        and bracketed soft tokens; its span (soft tokens and encoder rows) runs from the first
        frame's soft tokens to the last's (``video.py``)."""
        if modality == "video":
            layout, per_frame, times = self.video_layout(size)
            return ItemTokens(replacement=len(layout.replacement), placeholders=layout.span_length,
                              encoder_tokens=layout.span_length,
                              layout={"frames": size.frames, "tokens_per_frame": per_frame,
                                      "max_soft_tokens": self.video_settings.frame.max_soft_tokens,
                                      "timestamps": [timestamp(time) for time in times]})
        settings = self.request_settings(kwargs)
        tokens = settings.soft_tokens(size.height, size.width)
        return ItemTokens(replacement=tokens + 2, placeholders=tokens, encoder_tokens=tokens,
                          layout={"max_soft_tokens": settings.max_soft_tokens})


    def video_layout(self, size: ItemSize) -> tuple[FrameLayout, int, tuple[float, ...]]:
        """(layout, soft tokens per frame, frame times) of a video of ``size``; frames without
        times count as frames 0, 1, ... at 24 fps, as transformers counts bare frames."""
        if self.video_settings is None:
            raise BadRequestError("this Gemma 4 has no vision tower: it takes no video")
        times = size.frame_times or tuple(index / DEFAULT_FPS for index in range(size.frames))
        if len(times) != size.frames or size.frames < 1:
            raise ValueError(f"{len(times)} frame times for {size.frames} frames")
        per_frame = self.video_settings.frame.soft_tokens(size.height, size.width)
        layout = frame_layout(self.timestamp_ids, times, per_frame, self.boi_token_id, self.eoi_token_id,
                              self.video_token_id)
        return layout, per_frame, times

    def video_frame_indices(self, total: int, source_fps: float | None, policy) -> list[int]:
        """Gemma4VideoProcessor's sampler (``video.py``): the server's fps (--media-io-kwargs)
        or its num_frames, else the checkpoint's."""
        num_frames = self.video_settings.num_frames if self.video_settings else policy.video_num_frames
        return sample_frame_indices(total, source_fps, num_frames, policy.video_fps)


class Gemma4Processor(BaseMultiModalProcessor):
    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        info: Gemma4ProcessingInfo = self.info
        if modality == "video":
            return self.process_video(media)
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

    def process_video(self, video: Any) -> ProcessedItem:
        """Every kept frame resized as the video processor resizes it (``video.py``), uint8."""
        info: Gemma4ProcessingInfo = self.info
        frames = np.asarray(video)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
            raise BadRequestError("a video must decode to one or more RGB frames")
        size = ItemSize(frames.shape[2], frames.shape[1], len(frames), frame_times=frame_times(video))
        layout, per_frame, _ = info.video_layout(size)
        settings = info.video_settings.frame
        height, width = settings.resized(size.height, size.width)
        return ProcessedItem(
            encoder_inputs={"frames": resize_frames(frames, height, width), "patch_size": settings.patch_size,
                            "tokens_per_frame": per_frame, "frame_starts": layout.frame_starts,
                            "between": [np.asarray(ids, dtype=np.int64) for ids in layout.between]},
            replacement=list(layout.replacement),  # the layout may be cached: the item gets its own list
            placeholder_offset=layout.span_start, num_placeholders=layout.span_length,
        )

    def identifier(self, modality: str, media: Any, kwargs: dict[str, Any]) -> str:
        """A video's frame times are written into its prompt: the same frames at other times
        are another item (processor cache, encoder cache and prefix cache alike). A request's
        ``max_soft_tokens`` is the image processor's: it does not name a video."""
        if modality == "video":
            kwargs = {key: value for key, value in kwargs.items() if key != "max_soft_tokens"}
            kwargs["frame_times"] = list(frame_times(media))
        return item_identifier(self.info.ctx.model_id, modality, media, kwargs)

    def apply(self, prompt_token_ids: list[int], media: dict[str, list[Any]],
              kwargs: dict[str, Any] | None = None) -> ProcessorOutput:
        """A video's first timestamp is tokenized with the text before it, as transformers
        tokenizes the expanded prompt (``vlmd.processing.frame_text``)."""
        output = super().apply(prompt_token_ids, media, kwargs)
        return with_first_timestamps_joined(output, media.get("video") or [],
                                            lambda video: f"{timestamp(frame_times(video)[0])} ",
                                            self.info.ctx.tokenizer, self.family_state)


class Gemma4DummyInputsBuilder(BaseDummyInputsBuilder):
    """The most tokens an image can cost under the server's budget: of the sizes whose sides
    are whole pooling cells (a x b cells, a x b at most the budget), the one that costs most."""

    def dummy_item(self, modality: str) -> Any:
        if modality == "video":  # the most frames, each the costliest frame at the video budget
            frame = self.worst_image(self.info.video_settings.frame)
            return np.repeat(np.asarray(frame)[None], self.info.video_settings.num_frames, axis=0)
        return self.worst_image(self.info.server_settings())

    @staticmethod
    def worst_image(settings: ImageSettings) -> Image.Image:
        cell = settings.pooling_kernel_size * settings.patch_size
        budget = settings.max_soft_tokens
        best = max(((settings.soft_tokens(a * cell, (budget // a) * cell), a) for a in range(1, budget + 1)))
        across = best[1]
        return Image.new("RGB", ((budget // across) * cell, across * cell), color=(255, 255, 255))
