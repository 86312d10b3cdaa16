"""Qwen3-VL's pixel geometry: Qwen2-VL's rules (``vlmd_qwen2_vl.settings``) at Qwen3-VL's
parameters.

Qwen3-VL checkpoints name transformers' ``Qwen2VLImageProcessorPil``, so an image is resized,
limited and counted exactly as a Qwen2-VL one (smart resize to multiples of
``patch_size * merge_size``, an area within ``[min_pixels, max_pixels]``, 2x2 patches merged
into one token), with other defaults where the checkpoint names none: 16-px patches (so
multiples of 32) and mean = std = 0.5. The same code, not a copy, so the two families cannot
drift apart on sizes, limits, ``mm_processor_kwargs`` validation or token counts.

A video's settings are read the same way from the video processor's config (transformers'
``Qwen3VLVideoProcessor``), but its limits bound all frames together (``video.py``), and
its class defaults are its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vlmd_qwen2_vl.settings import DEFAULTS as QWEN2_VL_DEFAULTS
from vlmd_qwen2_vl.settings import KWARG_NAMES, VisionSettings, num_tokens, smart_resize
from vlmd_qwen2_vl.settings import read_settings as read_qwen2_vl_settings

__all__ = ["DEFAULTS", "KWARG_NAMES", "MODALITIES", "VisionSettings", "num_tokens", "read_settings", "read_video_rules",
           "smart_resize", "VideoRules"]

MODALITIES = ("image", "video")
HALF = (0.5, 0.5, 0.5)
# Where a checkpoint names none: the image processor's pixel limits (transformers' class
# defaults, the same as Qwen2-VL's), with Qwen3-VL's patch size and normalisation.
DEFAULTS = {
    "image": VisionSettings(min_pixels=QWEN2_VL_DEFAULTS["image"].min_pixels,
                            max_pixels=QWEN2_VL_DEFAULTS["image"].max_pixels,
                            patch_size=16, mean=HALF, std=HALF),
    # Qwen3VLVideoProcessor's class defaults (pixels of the whole video).
    "video": VisionSettings(min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32, patch_size=16, mean=HALF, std=HALF),
}


@dataclass(frozen=True)
class VideoRules:
    """The rest of a checkpoint's video processor config: its per-frame token cap (None: no
    cap, transformers 5.25's default; else ``max_video_tokens`` under ``cap_pixels_per_frame``)
    and its frame sampling (``fps``, ``min_frames``, ``max_frames``: Qwen3VLVideoProcessor's
    class defaults where the config names none)."""

    max_video_tokens: int | None = None
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768


DEFAULT_MAX_VIDEO_TOKENS = 768  # Qwen3VLVideoProcessor's per-frame cap, where one is asked for


def read_settings(model_dir: str, modality: str) -> VisionSettings:
    """The checkpoint's settings for ``modality``, read as Qwen2-VL's are (the processor
    configs, as transformers 5 looks them up), over Qwen3-VL's defaults."""
    return read_qwen2_vl_settings(model_dir, modality, DEFAULTS[modality])


def read_video_rules(model_dir: str) -> VideoRules:
    """The checkpoint's ``VideoRules``, from the video processor's config as transformers 5
    looks it up (``processor_config.json``'s nested entry, then its own file)."""
    nested = _load(Path(model_dir) / "processor_config.json").get("video_processor")
    raw = nested if nested is not None else _load(Path(model_dir) / "video_preprocessor_config.json")
    defaults = VideoRules()
    cap = int(raw.get("max_video_tokens") or DEFAULT_MAX_VIDEO_TOKENS) if raw.get("cap_pixels_per_frame") else None
    return VideoRules(max_video_tokens=cap, fps=float(raw.get("fps") or defaults.fps),
                      min_frames=int(raw.get("min_frames") or defaults.min_frames),
                      max_frames=int(raw.get("max_frames") or defaults.max_frames))


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
