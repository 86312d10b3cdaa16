"""The checkpoints scaling.py's servers load: the tiny builder's, widened where a sweep's
grid needs more than it declares.

The Qwen2-VL and LLaVA tiny configs declare 8,192 and 4,096 positions; their text models
use plain RoPE (no learned position table), so the count is only a limit and a copy that
declares more has the same weights. The tiny builder also caps Qwen2-VL's images at 100,352
pixels (128 tokens), so every image above ~316x316 would cost the same; the copy's processor
configs allow the largest size in the grid instead. The builder has no option for either.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import side_by_side

QWEN_FACTOR = 28  # Qwen2-VL: 14-px patches merged 2x2; an image token covers 28x28 pixels


def covering_pixels(sizes: list[tuple[int, int]]) -> int:
    """The least Qwen2-VL ``max_pixels`` that resizes none of ``sizes`` down: the largest
    area after rounding each side to a multiple of 28 (as smart_resize rounds)."""
    return max(max(QWEN_FACTOR, round(h / QWEN_FACTOR) * QWEN_FACTOR) * max(QWEN_FACTOR, round(w / QWEN_FACTOR) * QWEN_FACTOR)
               for w, h in sizes)


def widened_copy(model_dir: str, positions: int, max_pixels: int | None) -> str:
    """A sibling of ``model_dir`` declaring ``positions`` and, for image processors with a
    ``max_pixels``, that limit; weights hard-linked (copied across file systems)."""
    source = Path(model_dir)
    target = source.parent / (source.name + f"-ctx{positions}" + (f"-px{max_pixels}" if max_pixels else ""))
    if (target / "config.json").exists():
        return str(target)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    for item in source.iterdir():
        if item.suffix == ".safetensors":
            try:
                os.link(item, partial / item.name)
            except OSError:
                shutil.copy2(item, partial / item.name)
        elif item.is_file():
            shutil.copy2(item, partial / item.name)
    config = json.loads((partial / "config.json").read_text())
    declared = [c for c in (config, config.get("text_config") or {}) if "max_position_embeddings" in c]
    if not declared:
        raise ValueError(f"{source}/config.json declares no max_position_embeddings")
    for section in declared:
        section["max_position_embeddings"] = max(positions, section["max_position_embeddings"])
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    if max_pixels:
        for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
            path = partial / name
            if not path.exists():
                continue
            whole = json.loads(path.read_text())
            section = whole.get(key) if key else whole
            if isinstance(section, dict) and "max_pixels" in section:
                section["max_pixels"] = max_pixels
                if isinstance(section.get("size"), dict):
                    section["size"]["longest_edge"] = max_pixels
                path.write_text(json.dumps(whole, indent=2))
    partial.rename(target)
    return str(target)


def checkpoint(family: str, size: str, model_dir: str | None, positions: int, max_pixels: int | None) -> str:
    """The directory every server loads for ``family`` (see the module doc)."""
    if model_dir is None:
        from vlmd.config import cache_dir
        from vlmd.tiny import build_tiny

        target = cache_dir() / "bench" / f"{family}-{size}-seed0"
        if not (target / "config.json").exists():
            build_tiny(family, target, seed=0, size=size)
        model_dir = str(target)
    if family in side_by_side.PUBLISHED_LAYOUT_FAMILIES:  # the layout vLLM loads
        model_dir = side_by_side.published_layout(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    declared = (config.get("text_config") or config).get("max_position_embeddings", 0)
    if positions > declared or max_pixels:
        model_dir = widened_copy(model_dir, positions, max_pixels)
    return model_dir

