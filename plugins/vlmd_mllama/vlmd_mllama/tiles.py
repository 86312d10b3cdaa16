"""Llama 3.2 Vision's tiling: which canvas of square tiles an image is fitted to, read from
the checkpoint the way transformers' ``MllamaImageProcessor`` reads it.

An image is resized (keeping its aspect ratio, bilinear) to fit a canvas of ``rows x columns``
tiles of ``tile_size`` px, padded with black at the bottom and right to fill the canvas, and
cut into its tiles row by row. The canvas is chosen among every arrangement of at most
``max_image_tiles`` tiles: the smallest one the image can be scaled *up* into, else the one
it shrinks least into, and on a tie the smallest area. The aspect-ratio id the tower embeds
is the arrangement's index in that list, plus one (0 is the padding of an absent image).

The arithmetic below is transformers' (numpy float64 scales, ``np.clip``, ``math.floor``), so
canvases, sizes and ids agree exactly (``tests/test_mllama_processing.py`` checks it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # what the published checkpoints normalise with
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BILINEAR = 2


@dataclass(frozen=True)
class TileSettings:
    tile_size: int
    max_image_tiles: int
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = BILINEAR


@dataclass(frozen=True)
class Canvas:
    """Where one image goes: ``rows x columns`` tiles, the image resized to ``height x width``
    inside them (the rest black), and the tower's aspect-ratio id."""

    rows: int
    columns: int
    height: int
    width: int
    aspect_ratio_id: int

    @property
    def tiles(self) -> int:
        return self.rows * self.columns


def read_tile_settings(model_dir: str, hf_config) -> TileSettings:
    """The image processor's fields (``processor_config.json``'s nested ``image_processor``,
    transformers 5, else ``preprocessor_config.json``), checked against the tower's geometry:
    a tile of another size, or more tiles than the tower embeds, would be a load error."""
    raw = _image_processor_config(Path(model_dir))
    size = raw.get("size") or {"height": 224, "width": 224}
    if not isinstance(size, dict) or size.get("height") != size.get("width") or not size.get("height"):
        raise ValueError(f"the Mllama image processor's size {size!r} is not a square {{'height': S, 'width': S}}")
    settings = TileSettings(
        tile_size=int(size["height"]),
        max_image_tiles=int(raw.get("max_image_tiles", 4)),
        mean=tuple(float(x) for x in raw.get("image_mean", CLIP_MEAN)),
        std=tuple(float(x) for x in raw.get("image_std", CLIP_STD)),
        rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
        resample=int(raw.get("resample", BILINEAR)),
    )
    vision = hf_config.vision_config
    if settings.tile_size != int(vision.image_size):
        raise ValueError(f"the image processor's tiles are {settings.tile_size} px, the vision tower's "
                         f"{vision.image_size} px")
    if not 1 <= settings.max_image_tiles <= int(vision.max_num_tiles):
        raise ValueError(f"max_image_tiles {settings.max_image_tiles} is outside the vision tower's 1.."
                         f"{vision.max_num_tiles} tiles")
    if not (raw.get("do_resize", True) and raw.get("do_pad", True) and raw.get("do_rescale", True)
            and raw.get("do_normalize", True)):
        raise ValueError("the Mllama image processor must resize, pad, rescale and normalise (transformers "
                         "refuses the other modes too)")
    return settings


def _image_processor_config(model_dir: Path) -> dict:
    processor = _load(model_dir / "processor_config.json")
    nested = processor.get("image_processor")
    return nested if isinstance(nested, dict) else _load(model_dir / "preprocessor_config.json")


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


@lru_cache(maxsize=16)
def supported_aspect_ratios(max_image_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every arrangement of at most ``max_image_tiles`` tiles, in transformers' order."""
    return tuple((a, b) for a in range(1, max_image_tiles + 1) for b in range(1, max_image_tiles + 1)
                 if a * b <= max_image_tiles)


@lru_cache(maxsize=4096)
def optimal_canvas(height: int, width: int, max_image_tiles: int, tile_size: int) -> tuple[int, int]:
    """(canvas height, canvas width) in pixels: transformers' ``get_optimal_tiled_canvas``."""
    canvases = np.array(supported_aspect_ratios(max_image_tiles)) * tile_size
    target_heights, target_widths = canvases.T
    scale_h = target_heights / height
    scale_w = target_widths / width
    scales = np.where(scale_w > scale_h, scale_h, scale_w)  # the tighter side fits
    upscaling = scales[scales >= 1]
    selected = np.min(upscaling) if len(upscaling) > 0 else np.max(scales[scales < 1])
    chosen = canvases[scales == selected]
    best = chosen[np.argmin(chosen[:, 0] * chosen[:, 1])]  # on a tie the smallest area (the first of those)
    return int(best[0]), int(best[1])


def fit_to_canvas(height: int, width: int, canvas_height: int, canvas_width: int, tile_size: int) -> tuple[int, int]:
    """(height, width) of the resized image: transformers' ``get_image_size_fit_to_canvas``."""
    target_width = np.clip(width, tile_size, canvas_width)
    target_height = np.clip(height, tile_size, canvas_height)
    scale_h = target_height / height
    scale_w = target_width / width
    if scale_w < scale_h:
        return int(min(math.floor(height * scale_w) or 1, target_height)), int(target_width)
    return int(target_height), int(min(math.floor(width * scale_h) or 1, target_width))


def canvas_for(height: int, width: int, settings: TileSettings) -> Canvas:
    if height < 1 or width < 1:
        raise ValueError(f"an image of {width}x{height} pixels has no area")
    canvas_height, canvas_width = optimal_canvas(height, width, settings.max_image_tiles, settings.tile_size)
    rows, columns = canvas_height // settings.tile_size, canvas_width // settings.tile_size
    new_height, new_width = fit_to_canvas(height, width, canvas_height, canvas_width, settings.tile_size)
    ratio_id = supported_aspect_ratios(settings.max_image_tiles).index((rows, columns)) + 1
    return Canvas(rows, columns, new_height, new_width, ratio_id)
