"""Qwen3-VL's pixel geometry: Qwen2-VL's (smart resize to multiples of patch x merge, pixel
limits from the processor configs, --mm-processor-kwargs and per-request kwargs), with
Qwen3-VL's defaults where a checkpoint names none: 16-px patches (32-px resize factor) and
mean = std = 0.5, as its published ``preprocessor_config.json`` has them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from vlmd_qwen2_vl.settings import VisionSettings, _processor_config, read_settings

MODALITIES = ("image",)  # video (frames with timestamp text) is not served yet
HALF = (0.5, 0.5, 0.5)
DEFAULT_PATCH_SIZE = 16


def read_qwen3_vl_settings(model_dir: str, modality: str) -> VisionSettings:
    raw = _processor_config(Path(model_dir), modality)
    return replace(
        read_settings(model_dir, modality),
        patch_size=int(raw.get("patch_size", DEFAULT_PATCH_SIZE)),
        mean=tuple(float(v) for v in raw.get("image_mean", HALF)),
        std=tuple(float(v) for v in raw.get("image_std", HALF)),
    )
