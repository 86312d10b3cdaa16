"""Reading a checkpoint's safetensors files, with a progress bar on a terminal.

The bar is drawn only when stderr is a terminal, and it ends with its own line break
before the next log record, so a bar never shares a line with a log line; elsewhere
(files, pipes, CI) one log line reports the load instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import sys
import time

import structlog
import torch
from safetensors import safe_open
from tqdm import tqdm

log = structlog.get_logger(__name__)


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
    started = time.perf_counter()
    with tqdm(total=total, desc=desc, unit="tensor", leave=True, disable=not sys.stderr.isatty()) as progress:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                progress.update(1)
    log.info("weights read", tensors=total, files=len(files), seconds=round(time.perf_counter() - started, 2))
