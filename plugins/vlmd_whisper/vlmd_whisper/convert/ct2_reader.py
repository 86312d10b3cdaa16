"""Reading a CTranslate2 ``model.bin`` (binary versions 3-6) into numpy arrays.

Layout (little-endian, no padding; a tensor's bytes follow its header directly)::

    u32 binary_version
    str spec_name; u32 spec_revision                   (version >= 2)
    u32 num_variables, sorted by name; each:
        str name; u8 rank; u32 dims[rank]; u8 dtype_id; u32 num_bytes; bytes
    u32 num_aliases (version >= 3); each: str alias; str target

``str`` is a u16 length that counts a trailing NUL, then the utf-8 bytes and the NUL.
Quantized files store ``X/weight`` as int8 with ``X/weight_scale`` (float32, one scale per
output row: weight = int8 / scale); :func:`dequantized` turns those back into floats.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# dtype ids of binary version >= 4; older files store a type-name string instead.
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}
_OLD_DTYPES = {"float": np.float32, "float32": np.float32, "int8": np.int8, "int16": np.int16,
               "int32": np.int32, "float16": np.float16}
SUPPORTED_VERSIONS = range(3, 7)


@dataclass
class CT2Model:
    spec_name: str
    spec_revision: int
    variables: dict[str, np.ndarray] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> np.ndarray:
        """A variable by name, following aliases (e.g. a tied output projection)."""
        seen = set()
        while name in self.aliases and name not in seen:
            seen.add(name)
            name = self.aliases[name]
        if name not in self.variables:
            raise KeyError(f"CTranslate2 model has no variable {name!r}")
        return self.variables[name]

    def scalar(self, name: str) -> int:
        return int(np.asarray(self.get(name)).reshape(-1)[0])


class _Cursor:
    def __init__(self, data: bytes):
        self.data = memoryview(data)
        self.pos = 0

    def take(self, size: int) -> memoryview:
        if self.pos + size > len(self.data):
            raise ValueError("truncated CTranslate2 model file")
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return struct.unpack("<H", self.take(2))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def string(self) -> str:
        raw = bytes(self.take(self.u16()))
        return raw.rstrip(b"\0").decode("utf-8")


def read_ct2_model(path: str | Path) -> CT2Model:
    cursor = _Cursor(Path(path).read_bytes())
    version = cursor.u32()
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"unsupported CTranslate2 binary version {version} (supported: 3-6)")
    model = CT2Model(spec_name=cursor.string(), spec_revision=cursor.u32())
    for _ in range(cursor.u32()):
        name = cursor.string()
        dims = [cursor.u32() for _ in range(cursor.u8())]
        if version >= 4:
            dtype = _DTYPES.get(cursor.u8())
        else:
            dtype = _OLD_DTYPES.get(cursor.string())
        if dtype is None:
            raise ValueError(f"variable {name!r} has an unknown dtype")
        raw = cursor.take(cursor.u32())
        if dtype == "bfloat16":
            # numpy has no bfloat16: widen the 16 bits into the top half of a float32.
            array = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
        if array.size != int(np.prod(dims, dtype=np.int64)):
            raise ValueError(f"variable {name!r}: {array.size} values for dims {dims}")
        model.variables[name] = array.reshape(dims).copy()
    for _ in range(cursor.u32()):
        alias = cursor.string()
        model.aliases[alias] = cursor.string()
    return model


def dequantized(model: CT2Model, name: str) -> np.ndarray:
    """``name`` as float32, undoing int8/int16 quantization with its ``_scale`` variable."""
    array = model.get(name)
    if array.dtype in (np.int8, np.int16) and name.endswith("weight"):
        scale = model.get(name + "_scale").astype(np.float32)
        rows = scale.reshape(-1, *([1] * (array.ndim - 1))) if scale.size > 1 else scale.reshape(())
        return array.astype(np.float32) / rows
    return array.astype(np.float32)
