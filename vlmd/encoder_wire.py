"""The wire format of encoder outputs between servers (``--encoder-only`` -> ``--encoder-urls``).

A body is a safetensors file (https://github.com/huggingface/safetensors, "Format"), written
and read here without the library and without torch, so both ends and any tool can check
it: an 8-byte little-endian unsigned header length N, N bytes of UTF-8 JSON, then the raw
tensor bytes. The JSON maps each tensor's name (an item identifier, 64 hex digits) to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the byte after the
header) and holds ``"__metadata__"``, strings only: ``format`` (``FORMAT``), ``model`` (the
served model name) and, per identifier, ``modality:<identifier>``. Tensors are 2-D
``[encoder tokens, width]``, C order, little-endian. Nothing in it is executable: no pickle,
no ``torch.load``; the parser refuses anything else (docs/encoder-wire-format.md).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import orjson

FORMAT = "vlmd.encoder_outputs.v1"
MEDIA_TYPE = "application/vnd.vlmd.encoder-outputs+safetensors"
# safetensors' names for the floating dtypes an encoder emits, and their sizes in bytes.
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
_LENGTH = struct.Struct("<Q")
_IDENTIFIER = re.compile(r"[0-9a-f]{64}")
MAX_HEADER_BYTES = 1 << 20


class WireFormatError(ValueError):
    """Bytes that are not an encoder-outputs body of this format."""


@dataclass(frozen=True)
class WireTensor:
    """One encoder output as bytes: safetensors dtype name, shape, raw little-endian data."""

    modality: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview


def pack(tensors: dict[str, WireTensor], model: str) -> bytes:
    """The body for ``tensors`` by identifier (each checked as the parser will)."""
    header: dict = {"__metadata__": {"format": FORMAT, "model": model}}
    offset = 0
    for identifier, tensor in tensors.items():
        _check_tensor(identifier, tensor.dtype, tensor.shape, len(memoryview(tensor.data).cast("B")))
        size = len(memoryview(tensor.data).cast("B"))
        header[identifier] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        header["__metadata__"][f"modality:{identifier}"] = tensor.modality
        offset += size
    text = orjson.dumps(header)
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return b"".join([_LENGTH.pack(len(text)), text, *(memoryview(t.data).cast("B") for t in tensors.values())])


def unpack(body: bytes) -> tuple[str, dict[str, WireTensor]]:
    """(model, tensors by identifier) from a body, or WireFormatError saying what is wrong.

    Strict: the header is JSON of the shape above, every tensor 2-D of a listed dtype, the
    offsets tile the data exactly in order, no byte left over."""
    view = memoryview(body)
    if len(view) < _LENGTH.size:
        raise WireFormatError("the body is shorter than its 8-byte header length")
    (length,) = _LENGTH.unpack_from(view)
    if length > MAX_HEADER_BYTES or _LENGTH.size + length > len(view):
        raise WireFormatError(f"the header length {length} does not fit the body ({len(view)} bytes)")
    try:
        header = orjson.loads(bytes(view[_LENGTH.size : _LENGTH.size + length]).rstrip(b" "))
    except orjson.JSONDecodeError as exc:
        raise WireFormatError(f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireFormatError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise WireFormatError(f"the header's __metadata__.format is not {FORMAT!r}")
    if not all(isinstance(value, str) for value in metadata.values()):
        raise WireFormatError("__metadata__ values must be strings")
    data = view[_LENGTH.size + length :]
    tensors: dict[str, WireTensor] = {}
    position = 0
    for identifier, entry in sorted(header.items(), key=lambda kv: _begin(kv[1])):
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise WireFormatError(f"tensor {identifier[:16]!r} must have exactly dtype, shape and data_offsets")
        begin, end = entry["data_offsets"] if _is_pair(entry["data_offsets"]) else (-1, -1)
        if begin != position or end < begin or end > len(data):
            raise WireFormatError(f"tensor {identifier[:16]!r} has data offsets {entry['data_offsets']!r} "
                                  f"that do not tile the {len(data)} data bytes")
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise WireFormatError(f"tensor {identifier[:16]!r} has a shape that is not a list of integers")
        _check_tensor(identifier, entry["dtype"], tuple(shape), end - begin)
        modality = metadata.get(f"modality:{identifier}")
        if not modality:
            raise WireFormatError(f"tensor {identifier[:16]!r} has no modality in __metadata__")
        tensors[identifier] = WireTensor(modality, entry["dtype"], tuple(shape), data[begin:end])
        position = end
    if position != len(data):
        raise WireFormatError(f"{len(data) - position} data bytes belong to no tensor")
    return str(metadata.get("model", "")), tensors


def _check_tensor(identifier, dtype, shape: tuple, size: int) -> None:
    if not isinstance(identifier, str) or not _IDENTIFIER.fullmatch(identifier):
        raise WireFormatError(f"tensor name {str(identifier)[:70]!r} is not an item identifier (64 hex digits)")
    if dtype not in DTYPE_BYTES:
        raise WireFormatError(f"tensor {identifier[:16]} has dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    if len(shape) != 2 or min(shape) < 0:
        raise WireFormatError(f"tensor {identifier[:16]} has shape {list(shape)}; expected [tokens, width]")
    if shape[0] * shape[1] * DTYPE_BYTES[dtype] != size:
        raise WireFormatError(f"tensor {identifier[:16]} has {size} bytes for shape {list(shape)} of {dtype}")


def _is_pair(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(n, int) and not isinstance(n, bool) for n in value)


def _begin(entry) -> int:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    return offsets[0] if _is_pair(offsets) else -1
