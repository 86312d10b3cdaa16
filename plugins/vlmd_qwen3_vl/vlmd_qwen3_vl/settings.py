"""Qwen3-VL's pixel geometry: per-checkpoint settings, smart resize, limits, token counts.

An image is resized so both sides are multiples of ``patch_size * merge_size`` (32) and its
area lies within ``[min_pixels, max_pixels]``, keeping the aspect ratio as well as it can; it
then covers ``(h / 16) x (w / 16)`` patches, merged 2x2 into ``h * w / 32**2`` tokens. This is
the arithmetic of transformers' ``Qwen2VLImageProcessorPil``, which Qwen3-VL checkpoints name
(at 16-px patches, mean = std = 0.5).

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

MODALITIES = ("image",)  # video (frames with timestamp text) is not served yet
HALF = (0.5, 0.5, 0.5)
BICUBIC = 3
# transformers' image processor defaults when a checkpoint names no limits.
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 56 * 56, 28 * 28 * 1280
KWARG_NAMES = ("min_pixels", "max_pixels")


@dataclass(frozen=True)
class VisionSettings:
    min_pixels: int
    max_pixels: int
    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    resample: int = BICUBIC
    mean: tuple[float, ...] = HALF
    std: tuple[float, ...] = HALF

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def with_kwargs(self, kwargs: dict[str, Any]) -> "VisionSettings":
        """These settings under processor kwargs (already merged: server-wide, then request)."""
        unknown = sorted(set(kwargs) - set(KWARG_NAMES))
        if unknown:
            raise BadRequestError(f"unknown mm_processor_kwargs {unknown}; Qwen3-VL takes {list(KWARG_NAMES)}",
                                  param="mm_processor_kwargs")
        values = {}
        for name in KWARG_NAMES:
            if name in kwargs:
                value = kwargs[name]
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise BadRequestError(f"mm_processor_kwargs.{name} must be a positive integer",
                                          param="mm_processor_kwargs")
                values[name] = value
        settings = replace(self, **values)
        if settings.min_pixels > settings.max_pixels:
            raise BadRequestError(f"min_pixels {settings.min_pixels} is larger than max_pixels {settings.max_pixels}",
                                  param="mm_processor_kwargs")
        return settings


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width): multiples of ``factor`` with an area in [min_pixels, max_pixels], with
    the arithmetic of transformers' ``smart_resize``, so sizes and token counts agree exactly."""
    if max(height, width) / min(height, width) > 200:
        raise BadRequestError(f"aspect ratio of {width}x{height} is over 200:1, which Qwen3-VL cannot take")
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


def num_tokens(height: int, width: int, settings: VisionSettings) -> int:
    """Placeholder tokens of an image of this size."""
    h, w = smart_resize(height, width, settings.factor, settings.min_pixels, settings.max_pixels)
    return (h // settings.factor) * (w // settings.factor)


def read_settings(model_dir: str, modality: str) -> VisionSettings:
    """The checkpoint's settings for ``modality``: ``processor_config.json``'s nested
    ``image_processor`` first, then ``preprocessor_config.json``, as transformers 5 looks."""
    nested = _load(Path(model_dir) / "processor_config.json")
    raw = nested.get("image_processor") or _load(Path(model_dir) / "preprocessor_config.json")
    min_pixels, max_pixels = DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS
    size = raw.get("size")
    if isinstance(size, dict):
        min_pixels = int(size.get("shortest_edge", min_pixels))
        max_pixels = int(size.get("longest_edge", max_pixels))
    return VisionSettings(
        min_pixels=int(raw.get("min_pixels") or min_pixels),
        max_pixels=int(raw.get("max_pixels") or max_pixels),
        patch_size=int(raw.get("patch_size", 16)),
        merge_size=int(raw.get("merge_size", 2)),
        temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
        resample=int(raw.get("resample", BICUBIC)),
        mean=tuple(float(v) for v in raw.get("image_mean", HALF)),
        std=tuple(float(v) for v in raw.get("image_std", HALF)),
    )


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
