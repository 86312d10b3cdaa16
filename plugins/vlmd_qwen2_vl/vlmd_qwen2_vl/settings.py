"""Qwen2-VL's pixel geometry: per-modality settings from the checkpoint, smart resize, limits.

An image (or each frame of a video) is resized so both sides are multiples of
``patch_size * merge_size`` (28) and its area lies within ``[min_pixels, max_pixels]``,
keeping the aspect ratio as well as it can; it then covers ``(h / 14) x (w / 14)`` patches,
merged 2x2 into ``h * w / 28**2`` tokens per frame pair.

The limits come from the checkpoint's processor configs (read the way transformers reads
them), may be replaced server-wide (--mm-processor-kwargs) and narrowed per request
(``mm_processor_kwargs``). A request may not raise ``max_pixels`` above the server's: the
encoder budget and cache were sized at start-up for the server's largest item.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vlmd.errors import BadRequestError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3
KWARG_NAMES = ("min_pixels", "max_pixels")


@dataclass(frozen=True)
class VisionSettings:
    min_pixels: int
    max_pixels: int
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    resample: int = BICUBIC
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def with_kwargs(self, kwargs: dict[str, Any]) -> "VisionSettings":
        """These settings under processor kwargs (already merged: server-wide, then request)."""
        unknown = sorted(set(kwargs) - set(KWARG_NAMES))
        if unknown:
            raise BadRequestError(
                f"unknown mm_processor_kwargs {unknown}; this model takes {list(KWARG_NAMES)}",
                param="mm_processor_kwargs",
            )
        values = {}
        for name in KWARG_NAMES:
            if name in kwargs:
                value = kwargs[name]
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise BadRequestError(f"mm_processor_kwargs.{name} must be a positive integer", param="mm_processor_kwargs")
                values[name] = value
        settings = replace(self, **values)
        if settings.min_pixels > settings.max_pixels:
            raise BadRequestError(
                f"min_pixels {settings.min_pixels} is larger than max_pixels {settings.max_pixels}",
                param="mm_processor_kwargs",
            )
        return settings


# transformers' class defaults when a checkpoint names none.
DEFAULTS = {
    "image": VisionSettings(min_pixels=56 * 56, max_pixels=28 * 28 * 1280),
    "video": VisionSettings(min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768),
}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width): multiples of ``factor`` with an area in [min_pixels, max_pixels].

    Same arithmetic as transformers' ``smart_resize`` (Qwen2-VL), so sizes and token counts
    agree exactly.
    """
    if max(height, width) / min(height, width) > 200:
        raise BadRequestError(f"aspect ratio of {width}x{height} is over 200:1, which this model cannot take")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def num_tokens(height: int, width: int, settings: VisionSettings, num_frames: int = 1) -> int:
    """Placeholder tokens of an image (or a video of ``num_frames`` frames) of this size."""
    h, w = smart_resize(height, width, settings.factor, settings.min_pixels, settings.max_pixels)
    pairs = -(-num_frames // settings.temporal_patch_size)
    return pairs * (h // settings.factor) * (w // settings.factor)


def read_settings(model_dir: str, modality: str, defaults: VisionSettings | None = None) -> VisionSettings:
    """The checkpoint's settings for ``modality`` ("image" or "video"); what it does not name
    is taken from ``defaults``: Qwen2-VL's unless a family with the same geometry passes its
    own (Qwen3-VL: 16-px patches, mean = std = 0.5)."""
    base = DEFAULTS[modality] if defaults is None else defaults
    raw = _processor_config(Path(model_dir), modality)
    min_pixels, max_pixels = base.min_pixels, base.max_pixels
    size = raw.get("size")
    if isinstance(size, dict):
        min_pixels = int(size.get("shortest_edge", min_pixels))
        max_pixels = int(size.get("longest_edge", max_pixels))
    min_pixels = int(raw.get("min_pixels") or min_pixels)
    max_pixels = int(raw.get("max_pixels") or max_pixels)
    return VisionSettings(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=int(raw.get("patch_size", base.patch_size)),
        merge_size=int(raw.get("merge_size", base.merge_size)),
        temporal_patch_size=int(raw.get("temporal_patch_size", base.temporal_patch_size)),
        resample=int(raw.get("resample", base.resample)),
        mean=tuple(float(v) for v in raw.get("image_mean", base.mean)),
        std=tuple(float(v) for v in raw.get("image_std", base.std)),
    )


def _processor_config(model_dir: Path, modality: str) -> dict:
    """As transformers 5 looks it up: processor_config.json's nested entry first, then the
    modality's own file; a video without its own config uses the image processor's."""
    nested = _load(model_dir / "processor_config.json")
    if modality == "video":
        if "video_processor" in nested:
            return nested["video_processor"]
        own = _load(model_dir / "video_preprocessor_config.json")
        if own:
            return own
    if "image_processor" in nested:
        return nested["image_processor"]
    return _load(model_dir / "preprocessor_config.json")


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
