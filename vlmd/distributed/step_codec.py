"""The step channel's wire format: typed data, never pickle.

What rank 0 broadcasts to the other tensor-parallel ranks (``StartupPlan``, ``StepMessage``
with its ``SchedulerOutput``) is plain data: vlmd's dataclasses and enums, ints, floats,
strings, containers, and arrays (media inputs, family state). Pickle would rebuild whatever
the bytes name, running any callable they name, on a socket another host can reach; this
format can only rebuild what it describes, from an allow-list.

Layout: ``u64`` length of a JSON header, the header, then the raw array bytes. In the header
every value is JSON itself (null, bool, number, string) or a one-key object naming its kind:
``{"l": [...]}`` list, ``{"t": [...]}`` tuple, ``{"s": [...]}`` set, ``{"d": [[k, v], ...]}``
dict (keys of any encodable kind), ``{"b": [offset, length]}`` bytes, ``{"np": [dtype,
shape, offset, length]}`` a numpy array, ``{"pt": [dtype, shape, offset, length]}`` a CPU
torch tensor, ``{"e": [class, value]}`` an enum member, ``{"dc": [class, {field: value}]}``
a dataclass. A class is named ``module:qualname`` and is accepted only when its module is
vlmd's or a vlmd plugin's (``vlmd`` or ``vlmd_*``), is already imported (decoding never
imports), and the class is a dataclass or an ``Enum``; a dataclass is rebuilt field by field
without calling its ``__init__`` (nothing of the sender's choosing runs). Anything else
raises ``TypeError`` on the sending side, naming the type.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
import sys

import numpy as np
import torch

_LENGTH = struct.Struct("<Q")
# torch dtypes by name; bfloat16 travels as its raw 16-bit pattern.
_TORCH_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


def encode(value) -> bytes:
    blobs: list[bytes] = []
    offset = [0]

    def blob(data: bytes) -> list[int]:
        blobs.append(data)
        start = offset[0]
        offset[0] += len(data)
        return [start, len(data)]

    def walk(item):
        if item is None or isinstance(item, (bool, str)):
            return item
        if isinstance(item, enum.Enum):  # before int: an IntEnum is an int too
            return {"e": [_class_name(type(item)), walk(item.value)]}
        if isinstance(item, (int, float)):
            return item
        if isinstance(item, list):
            return {"l": [walk(x) for x in item]}
        if isinstance(item, tuple) and not hasattr(item, "_fields"):
            return {"t": [walk(x) for x in item]}
        if isinstance(item, (set, frozenset)):
            return {"s": [walk(x) for x in item]}
        if isinstance(item, dict):
            return {"d": [[walk(k), walk(v)] for k, v in item.items()]}
        if isinstance(item, (bytes, bytearray)):
            return {"b": blob(bytes(item))}
        if isinstance(item, np.ndarray):
            if item.dtype == object:
                raise TypeError("an object array cannot cross the step channel")
            array = np.ascontiguousarray(item)
            return {"np": [array.dtype.str, list(array.shape), *blob(array.tobytes())]}
        if isinstance(item, torch.Tensor):
            name = str(item.dtype).removeprefix("torch.")
            if name not in _TORCH_DTYPES or item.device.type != "cpu":
                raise TypeError(f"a {item.dtype} tensor on {item.device} cannot cross the step channel")
            raw = item.detach().contiguous()
            raw = raw.view(torch.int16) if raw.dtype == torch.bfloat16 else raw
            return {"pt": [name, list(item.shape), *blob(raw.numpy().tobytes())]}
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            fields = {f.name: walk(getattr(item, f.name)) for f in dataclasses.fields(item)}
            return {"dc": [_class_name(type(item)), fields]}
        raise TypeError(f"{type(item).__module__}.{type(item).__qualname__} cannot cross the step channel "
                        "(plain data, numpy arrays, CPU tensors, vlmd dataclasses and enums only)")

    header = json.dumps(walk(value), separators=(",", ":")).encode()
    return _LENGTH.pack(len(header)) + header + b"".join(blobs)


def decode(data: bytes):
    if len(data) < _LENGTH.size:
        raise ValueError("step message shorter than its header length")
    (length,) = _LENGTH.unpack_from(data)
    body = memoryview(data)[_LENGTH.size + length:]
    tree = json.loads(bytes(data[_LENGTH.size : _LENGTH.size + length]))

    def span(start: int, size: int) -> bytes:
        if start < 0 or size < 0 or start + size > len(body):
            raise ValueError("step message refers past its data")
        return bytes(body[start : start + size])

    def walk(item):
        if not isinstance(item, dict):
            if isinstance(item, list):
                raise ValueError("bare list in a step message")
            return item
        if len(item) != 1:
            raise ValueError("malformed value in a step message")
        (kind, payload), = item.items()
        if kind == "l":
            return [walk(x) for x in payload]
        if kind == "t":
            return tuple(walk(x) for x in payload)
        if kind == "s":
            return {walk(x) for x in payload}
        if kind == "d":
            return {walk(k): walk(v) for k, v in payload}
        if kind == "b":
            return span(*payload)
        if kind == "np":
            dtype, shape, start, size = payload
            return np.frombuffer(span(start, size), dtype=np.dtype(dtype)).reshape(shape).copy()
        if kind == "pt":
            name, shape, start, size = payload
            dtype = _TORCH_DTYPES[name]
            raw = torch.frombuffer(bytearray(span(start, size)), dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
            return (raw.view(torch.bfloat16) if dtype == torch.bfloat16 else raw).reshape(shape)
        if kind == "e":
            return _resolve(payload[0], enum.Enum)(walk(payload[1]))
        if kind == "dc":
            cls = _resolve(payload[0], None)
            obj = cls.__new__(cls)
            names = {f.name for f in dataclasses.fields(cls)}
            if set(payload[1]) != names:
                raise ValueError(f"step message fields of {payload[0]} differ from the class's")
            for name, value in payload[1].items():
                object.__setattr__(obj, name, walk(value))
            return obj
        raise ValueError(f"unknown kind {kind!r} in a step message")

    return walk(tree)


def _class_name(cls: type) -> str:
    name = f"{cls.__module__}:{cls.__qualname__}"
    _resolve(name, enum.Enum if issubclass(cls, enum.Enum) else None)  # refuse on the sending side too
    return name


def _resolve(name: str, base: type | None) -> type:
    module_name, _, qualname = name.partition(":")
    if not (module_name == "vlmd" or module_name.startswith(("vlmd.", "vlmd_"))):
        raise TypeError(f"{name} is not a vlmd class: it cannot cross the step channel")
    module = sys.modules.get(module_name)  # never imported here: only what this rank loaded
    cls = module
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not isinstance(cls, type):
        raise TypeError(f"{name} is not a class this rank has loaded")
    if base is not None and not issubclass(cls, base):
        raise TypeError(f"{name} is not an enum")
    if base is None and not dataclasses.is_dataclass(cls):
        raise TypeError(f"{name} is not a dataclass")
    return cls
