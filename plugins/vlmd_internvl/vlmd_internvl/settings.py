"""An InternVL checkpoint's media settings, read the way transformers reads them.

The image (and video) processor's fields (tile size, ``min_patches``/``max_patches``,
mean and std, resampling) come from ``processor_config.json``'s nested ``image_processor``
(transformers 5) or ``preprocessor_config.json`` (4.x); the placeholders per tile
(``image_seq_length``) from the processor's own config. The tower's geometry fixes that
count too (``(image_size / patch_size)**2 * downsample_ratio**2``): a checkpoint whose two
figures disagree would misplace every embedding, so it is refused at load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vlmd_internvl.tiling import TileSettings

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # GotOcr2ImageProcessor's class defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3


@dataclass(frozen=True)
class PixelNorm:
    mean: tuple[float, ...]
    std: tuple[float, ...]


def tower_tokens_per_tile(hf_config) -> int:
    """Placeholders one tile becomes: the tower's patch grid, pixel-shuffled."""
    vision = hf_config.vision_config
    image_size = _pair(vision.image_size)
    patch_size = _pair(vision.patch_size)
    patches = (image_size[0] // patch_size[0]) * (image_size[1] // patch_size[1])
    return round(patches * float(hf_config.downsample_ratio) ** 2)


def read_tile_settings(model_dir: str, hf_config) -> TileSettings:
    """The image processor's ``crop_to_patches`` is not read: InternVLProcessor's own default
    (True) overrides it, so published configs saying false are tiled all the same."""
    raw = image_processor_config(Path(model_dir))
    size = raw.get("size") or {"height": 384, "width": 384}
    if not isinstance(size, dict) or "height" not in size or "width" not in size:
        raise ValueError(f"InternVL image processor size {size!r} is not {{'height': H, 'width': W}}")
    tokens = tower_tokens_per_tile(hf_config)
    declared = _load(Path(model_dir) / "processor_config.json").get("image_seq_length", tokens)
    if int(declared) != tokens:
        raise ValueError(f"processor image_seq_length {declared} differs from the {tokens} tokens the vision "
                         "tower makes per tile")
    return TileSettings(
        tile_height=int(size["height"]),
        tile_width=int(size["width"]),
        min_patches=int(raw.get("min_patches", 1)),
        max_patches=int(raw.get("max_patches", 12)),
        tokens_per_tile=tokens,
        resample=int(raw.get("resample", BICUBIC)),
    )


@dataclass(frozen=True)
class FrameSettings:
    """How a video's frames are resized: each to one tile."""

    height: int
    width: int
    resample: int


def read_frame_settings(model_dir: str, tiles: TileSettings) -> FrameSettings | None:
    """The video processor's frame size (the tile size where the checkpoint names none), or
    None: the reference gives every frame ``tokens_per_tile`` placeholders whatever its size,
    so frames of another size could not be encoded, and such a checkpoint serves images only."""
    raw = video_processor_config(Path(model_dir))
    size = raw.get("size") or {"height": tiles.tile_height, "width": tiles.tile_width}
    if (size.get("height"), size.get("width")) != (tiles.tile_height, tiles.tile_width):
        return None
    return FrameSettings(tiles.tile_height, tiles.tile_width, int(raw.get("resample", tiles.resample)))


def read_pixel_norm(model_dir: str, modality: str = "image") -> PixelNorm:
    """Mean and std of a modality's processor (a video's falls back to the image's)."""
    image = image_processor_config(Path(model_dir))
    raw = {**image, **video_processor_config(Path(model_dir))} if modality == "video" else image
    return PixelNorm(tuple(float(v) for v in raw.get("image_mean", CLIP_MEAN)),
                     tuple(float(v) for v in raw.get("image_std", CLIP_STD)))


def image_processor_config(model_dir: Path) -> dict:
    nested = _load(model_dir / "processor_config.json")
    if "image_processor" in nested:
        return nested["image_processor"]
    return _load(model_dir / "preprocessor_config.json")


def video_processor_config(model_dir: Path) -> dict:
    nested = _load(model_dir / "processor_config.json")
    if "video_processor" in nested:
        return nested["video_processor"]
    return _load(model_dir / "video_preprocessor_config.json")


def _pair(value) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (list, tuple)) else (int(value), int(value))


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
