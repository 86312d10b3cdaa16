"""Qwen3-VL's pixel geometry: Qwen2-VL's rules (``vlmd_qwen2_vl.settings``) at Qwen3-VL's
parameters.

Qwen3-VL checkpoints name transformers' ``Qwen2VLImageProcessorPil``, so an image is resized,
limited and counted exactly as a Qwen2-VL one (smart resize to multiples of
``patch_size * merge_size``, an area within ``[min_pixels, max_pixels]``, 2x2 patches merged
into one token), with other defaults where the checkpoint names none: 16-px patches (so
multiples of 32) and mean = std = 0.5. The same code, not a copy, so the two families cannot
drift apart on sizes, limits, ``mm_processor_kwargs`` validation or token counts.
"""

from __future__ import annotations

from vlmd_qwen2_vl.settings import DEFAULTS as QWEN2_VL_DEFAULTS
from vlmd_qwen2_vl.settings import KWARG_NAMES, VisionSettings, num_tokens, smart_resize
from vlmd_qwen2_vl.settings import read_settings as read_qwen2_vl_settings

__all__ = ["DEFAULTS", "KWARG_NAMES", "MODALITIES", "VisionSettings", "num_tokens", "read_settings", "smart_resize"]

MODALITIES = ("image",)  # video (frames with timestamp text) is not served yet
HALF = (0.5, 0.5, 0.5)
# Where a checkpoint names none: the image processor's pixel limits (transformers' class
# defaults, the same as Qwen2-VL's), with Qwen3-VL's patch size and normalisation.
DEFAULTS = {
    "image": VisionSettings(min_pixels=QWEN2_VL_DEFAULTS["image"].min_pixels,
                            max_pixels=QWEN2_VL_DEFAULTS["image"].max_pixels,
                            patch_size=16, mean=HALF, std=HALF),
}


def read_settings(model_dir: str, modality: str) -> VisionSettings:
    """The checkpoint's settings for ``modality``, read as Qwen2-VL's are (the processor
    configs, as transformers 5 looks them up), over Qwen3-VL's defaults."""
    return read_qwen2_vl_settings(model_dir, modality, DEFAULTS[modality])
