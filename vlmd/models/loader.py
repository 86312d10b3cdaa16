"""Reading a checkpoint's safetensors files, with a progress bar on a terminal.

The bar is drawn only when stderr is a terminal, and it ends with its own line break
before the next log record, so a bar never shares a line with a log line; elsewhere
(files, pipes, CI) one log line reports the load instead.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

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


class _Skip:
    """The target of a ``WeightNames`` row whose tensors the model does not use."""

    def __repr__(self) -> str:
        return "SKIP"


SKIP: Final = _Skip()


@dataclass(frozen=True)
class WeightNames:
    """A family's checkpoint names -> the names of its modules, as data.

    ``prefixes`` is an ordered table of ``(checkpoint prefix, our prefix)`` rows. ``target(name)``
    takes the first row whose checkpoint prefix starts ``name`` and puts our prefix in its
    place; a row whose target is ``SKIP`` drops those tensors (``target`` returns None); a
    name no row matches is an error naming it and ``family``. Longer prefixes go first: a row
    that an earlier row's prefix already covers could never match, so the table is refused
    when it is made (the order is checked once, not discovered at load time).
    """

    family: str
    prefixes: tuple[tuple[str, str | _Skip], ...]

    def __post_init__(self) -> None:
        seen: list[str] = []
        for row in self.prefixes:
            if len(row) != 2 or not isinstance(row[0], str) or not (isinstance(row[1], str) or row[1] is SKIP):
                raise ValueError(f"{self.family} weight names: {row!r} is not a (prefix, prefix or SKIP) row")
            prefix = row[0]
            if not prefix:
                raise ValueError(f"{self.family} weight names: an empty checkpoint prefix matches every name")
            shadow = next((earlier for earlier in seen if prefix.startswith(earlier)), None)
            if shadow is not None:
                raise ValueError(f"{self.family} weight names: {prefix!r} comes after {shadow!r}, which "
                                 f"matches every name it would, so it never applies (put the longer first)")
            seen.append(prefix)

    def target(self, name: str) -> str | None:
        """Our name for checkpoint tensor ``name``, or None where its row says ``SKIP``."""
        for prefix, ours in self.prefixes:
            if name.startswith(prefix):
                return None if ours is SKIP else ours + name[len(prefix):]
        raise ValueError(f"unexpected weight {name!r} in {self.family} checkpoint")


def load_multimodal_weights(
    weights: Iterable[tuple[str, torch.Tensor]], names: WeightNames,
    encoder_params: dict[str, torch.nn.Parameter], language_model, encoder_prefix: str = "",
    not_built: Callable[[str], bool] | None = None,
) -> None:
    """A vision/audio-language checkpoint into its model. Each name goes through ``names``
    (a ``SKIP`` row drops the tensor); ``language_model.*`` targets go to
    ``language_model.load_weights`` (which loads only this rank's shard), every other tensor
    into ``encoder_params`` (keyed without ``encoder_prefix``). A name that is unknown, a
    shape that differs, or a parameter left unfilled is an error naming the family.
    ``not_built(target)`` names weights this configuration of the model does not build (tower
    layers past the feature layer: it depends on the config, so it is not a table row); their
    parameters are not expected to be filled either."""
    family = names.family
    text_weights = []
    filled: set[str] = set()
    for name, tensor in weights:
        target = names.target(name)
        if target is None:
            continue
        if target.startswith("language_model."):
            text_weights.append((target[len("language_model."):], tensor))
            continue
        if not_built is not None and not_built(target):
            continue
        key = target[len(encoder_prefix):] if target.startswith(encoder_prefix) else target
        if key not in encoder_params:
            raise ValueError(f"unexpected weight {name!r} in {family} checkpoint")
        if encoder_params[key].shape != tensor.shape:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(encoder_params[key].shape)}"
            )
        with torch.no_grad():
            encoder_params[key].copy_(tensor)
        filled.add(key)
    loaded = language_model.load_weights(text_weights)
    expected = {key for key in encoder_params if not_built is None or not not_built(encoder_prefix + key)}
    # named_parameters() lists a tied lm_head once, as embed_tokens.
    missing = sorted(expected - filled) + sorted({name for name, _ in language_model.named_parameters()} - loaded)
    if missing:
        raise ValueError(f"{family} checkpoint lacks weights, e.g. {missing[:3]}")


def load_into(param: torch.Tensor, tensor: torch.Tensor, name: str, shard=None) -> None:
    """One checkpoint tensor (``name``) into its parameter: through the parameter's
    ``weight_loader`` where it has one (a linear layer's, which takes this rank's slice, or
    the ``shard`` of a fused projection), else copied after a shape check. Every error names
    the checkpoint's weight."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        try:
            loader(param, tensor, shard)
        except ValueError as exc:
            raise ValueError(f"weight {name!r}: {exc}") from None
        return
    if shard is not None:
        raise ValueError(f"weight {name!r} is part {shard!r} of a fused projection, but its parameter is not one")
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
