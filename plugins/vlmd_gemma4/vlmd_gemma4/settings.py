"""Gemma 4's image settings and its token budget, as transformers' ``Gemma4ImageProcessorPil``.

An image is resized, its aspect ratio kept, to the largest size whose sides are multiples of
``pooling_kernel_size x patch_size`` and whose patches number at most ``max_soft_tokens x
pooling_kernel_size**2``; the tower pools each ``k x k`` patches into one soft token. So the
budget (``max_soft_tokens``, one of 70, 140, 280, 560, 1120) bounds what an image costs, and a
request may lower it (``mm_processor_kwargs``) but not raise it past the server's (the
start-up profile and the encoder budget were sized for the server's).
Pure arithmetic here (no pixels), so `vlmd cost` and the processor agree.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmd.errors import BadRequestError

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)


@dataclass(frozen=True)
class ImageSettings:
    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    resample: int = 3  # PIL bicubic

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    def with_budget(self, kwargs: dict[str, Any], limit: int | None = None) -> "ImageSettings":
        """These settings under ``mm_processor_kwargs``' ``max_soft_tokens``, at most ``limit``
        (a request's: the server's budget; None for the server's own flag)."""
        if "max_soft_tokens" not in kwargs:
            return self
        budget = kwargs["max_soft_tokens"]
        if isinstance(budget, bool) or budget not in SUPPORTED_SOFT_TOKENS:
            raise BadRequestError(f"mm_processor_kwargs.max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}",
                                  param="mm_processor_kwargs")
        if limit is not None and budget > limit:
            raise BadRequestError(f"mm_processor_kwargs.max_soft_tokens {budget} is past this server's {limit} "
                                  "(start it with --mm-processor-kwargs '{\"max_soft_tokens\": N}')",
                                  param="mm_processor_kwargs")
        return dataclasses.replace(self, max_soft_tokens=int(budget))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """transformers' ``get_aspect_ratio_preserving_size``: (height, width) after the resize."""
        side = self.pooling_kernel_size * self.patch_size
        factor = math.sqrt(self.max_patches * self.patch_size ** 2 / (height * width))
        target_height = int(math.floor(factor * height / side)) * side
        target_width = int(math.floor(factor * width / side)) * side
        if target_height == 0 and target_width == 0:
            raise BadRequestError(f"a {width}x{height} image cannot be resized for Gemma 4's tower")
        longest = (self.max_patches // self.pooling_kernel_size ** 2) * side
        if target_height == 0:
            target_height, target_width = side, min(int(math.floor(width / height)) * side, longest)
        elif target_width == 0:
            target_width, target_height = side, min(int(math.floor(height / width)) * side, longest)
        if target_height * target_width > self.max_patches * self.patch_size ** 2:
            raise BadRequestError(f"a {width}x{height} image is too long and thin for Gemma 4's tower "
                                  f"at {self.max_soft_tokens} tokens")
        return target_height, target_width

    def soft_tokens(self, height: int, width: int) -> int:
        """Tokens an image of this size costs: its patches after the resize, pooled k x k."""
        target_height, target_width = self.resized(height, width)
        patches = (target_height // self.patch_size) * (target_width // self.patch_size)
        return patches // self.pooling_kernel_size ** 2


def read_settings(model_dir: str, vision_config) -> ImageSettings:
    """The checkpoint's image processor settings (``preprocessor_config.json``, or
    ``processor_config.json``'s ``image_processor``), the tower's patch and pooling sizes
    where the files leave them out."""
    raw: dict = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = Path(model_dir) / name
        if path.exists():
            data = json.loads(path.read_text(encoding="utf-8"))
            raw = data.get("image_processor", data)
            break
    settings = ImageSettings(
        patch_size=int(raw.get("patch_size", vision_config.patch_size)),
        max_soft_tokens=int(raw.get("max_soft_tokens", ImageSettings.max_soft_tokens)),
        pooling_kernel_size=int(raw.get("pooling_kernel_size", vision_config.pooling_kernel_size)),
        resample=int(raw.get("resample", ImageSettings.resample)),
    )
    if settings.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        raise ValueError(f"{model_dir}: max_soft_tokens {settings.max_soft_tokens} is not one of {SUPPORTED_SOFT_TOKENS}")
    return settings
