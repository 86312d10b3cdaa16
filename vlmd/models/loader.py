"""Reading a checkpoint's safetensors files, with a progress bar on a terminal.

The bar is drawn only when stderr is a terminal, and it ends with its own line break
before the next log record, so a bar never shares a line with a log line; elsewhere
(files, pipes, CI) one log line reports the load instead.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from pathlib import Path

import sys
import time

import structlog
import torch
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
    """Every checkpoint tensor as a read-only view of the memory-mapped file.

    Nothing is read until a parameter's loader copies from the view, and then only the pages
    it copies: a tensor-parallel rank that narrows a weight to its rows reads only its shard
    from disk (its columns, for a row-parallel weight: whole pages of rows wider than a page
    are skipped where they hold other ranks' columns).
    """
    files = safetensors_files(model_dir)
    tables = [_header(path) for path in files]
    total = sum(len(table) for _, table in tables)
    started = time.perf_counter()
    with tqdm(total=total, desc=desc, unit="tensor", leave=True, disable=not sys.stderr.isatty()) as progress:
        for path, (data_start, table) in zip(files, tables):
            with open(path, "rb") as handle:
                # ACCESS_COPY: writable (torch.frombuffer wants that) but never written back.
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            raw = torch.frombuffer(mapped, dtype=torch.uint8) if len(mapped) else torch.empty(0, dtype=torch.uint8)
            for name, entry in table.items():
                begin, end = entry["data_offsets"]
                dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {entry['dtype']}")
                data = raw[data_start + begin : data_start + end]
                try:
                    tensor = data.view(dtype)
                except RuntimeError:  # not aligned to its element size: a copy
                    tensor = data.clone().view(dtype)
                yield name, tensor.view(entry["shape"])
                progress.update(1)
    log.info("weights read", tensors=total, files=len(files), seconds=round(time.perf_counter() - started, 2))


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _header(path: Path) -> tuple[int, dict]:
    """(first data byte, {name: entry}) of a safetensors file: an 8-byte little-endian length,
    then that much JSON (dtype, shape, data_offsets per tensor; ``__metadata__``)."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if length <= 0 or length > 100 * 2**20:
            raise ValueError(f"{path.name} is not a safetensors file (header length {length})")
        table = json.loads(handle.read(length))
    table.pop("__metadata__", None)
    return 8 + length, table
