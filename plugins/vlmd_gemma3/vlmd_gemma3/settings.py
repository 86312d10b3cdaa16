"""Gemma 3's image settings and pan-and-scan, as transformers' ``Gemma3ImageProcessorPil``.

Every image (and every pan-and-scan crop) is resized to one square (``size``), so an image
costs the same tokens whatever its size unless pan-and-scan cuts it into crops: then the
original and each crop are one image sequence of ``mm_tokens_per_image`` tokens each.
Pure arithmetic here (no pixels), so ``vlmd cost`` and the processor agree.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmd.errors import BadRequestError

# Request-level kwargs this family reads (mm_processor_kwargs), with their types.
KWARGS = {"do_pan_and_scan": bool, "pan_and_scan_min_crop_size": int, "pan_and_scan_max_num_crops": int,
          "pan_and_scan_min_ratio_to_activate": float}


@dataclass(frozen=True)
class ImageSettings:
    size: int  # the square side every image and crop is resized to
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: int  # PIL filter
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2

    def with_kwargs(self, kwargs: dict[str, Any]) -> "ImageSettings":
        changes = {}
        for name, kind in KWARGS.items():
            if name not in kwargs:
                continue
            value = kwargs[name]
            if kind is bool and not isinstance(value, bool) or kind is not bool and (
                    isinstance(value, bool) or not isinstance(value, (int, float))):
                raise BadRequestError(f"mm_processor_kwargs.{name} must be a {kind.__name__}", param="mm_processor_kwargs")
            if kind is not bool and value <= 0:
                raise BadRequestError(f"mm_processor_kwargs.{name} must be positive", param="mm_processor_kwargs")
            changes[name] = kind(value)
        return dataclasses.replace(self, **changes) if changes else self


def read_settings(model_dir: str) -> ImageSettings:
    """The checkpoint's image processor settings (``preprocessor_config.json``)."""
    path = Path(model_dir) / "preprocessor_config.json"
    raw = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    size = raw.get("size") or {"height": 896, "width": 896}
    if size.get("height") != size.get("width"):
        raise ValueError(f"{path}: Gemma 3 resizes to a square, got size {size}")
    defaults = ImageSettings(size=int(size["height"]), mean=(0.5,) * 3, std=(0.5,) * 3, resample=2)
    fields = {name: raw[name] for name in KWARGS if raw.get(name) is not None}
    return dataclasses.replace(
        defaults, mean=tuple(raw.get("image_mean", defaults.mean)), std=tuple(raw.get("image_std", defaults.std)),
        resample=int(raw.get("resample", defaults.resample)), **fields,
    )


def crop_boxes(width: int, height: int, settings: ImageSettings) -> list[tuple[int, int, int, int]]:
    """Pan-and-scan crops of a ``width`` x ``height`` image as (left, top, right, bottom),
    clipped to the image (transformers slices the array); [] where it does not apply."""
    if not settings.do_pan_and_scan:
        return []
    min_size, max_crops = settings.pan_and_scan_min_crop_size, settings.pan_and_scan_max_num_crops
    if width >= height:
        if width / height < settings.pan_and_scan_min_ratio_to_activate:
            return []
        across = min(int(math.floor(width / min_size)), int(math.floor(width / height + 0.5)))
        across, down = min(max_crops, max(2, across)), 1
    else:
        if height / width < settings.pan_and_scan_min_ratio_to_activate:
            return []
        down = min(int(math.floor(height / min_size)), int(math.floor(height / width + 0.5)))
        across, down = 1, min(max_crops, max(2, down))
    crop_w, crop_h = int(math.ceil(width / across)), int(math.ceil(height / down))
    if min(crop_w, crop_h) < min_size:
        return []
    return [(left, top, min(left + crop_w, width), min(top + crop_h, height))
            for top in range(0, crop_h * down, crop_h) for left in range(0, crop_w * across, crop_w)]
