"""Reading a checkpoint's safetensors files, with a progress bar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    return files


def iterate_weights(model_dir: str | Path, desc: str = "loading weights") -> Iterator[tuple[str, torch.Tensor]]:
    files = safetensors_files(model_dir)
    handles = [safe_open(str(path), framework="pt") for path in files]
    total = sum(len(list(handle.keys())) for handle in handles)
    with tqdm(total=total, desc=desc, unit="tensor", leave=False) as progress:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                progress.update(1)
