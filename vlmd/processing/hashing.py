"""blake3 identifiers for media items.

The identifier covers the model, the modality, the decoded content *with its shape and
mode* and the processor kwargs: two different images whose bytes happen to match (or a
different size of the same bytes) never share an identifier, so they never share a
processor-cache entry, an encoder output or a prefix-cache block.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from blake3 import blake3
from PIL import Image


def _feed(hasher: blake3, value: Any) -> None:
    if isinstance(value, Image.Image):
        hasher.update(f"image:{value.mode}:{value.size[0]}x{value.size[1]}:".encode())
        hasher.update(value.tobytes())
    elif isinstance(value, np.ndarray):
        hasher.update(f"ndarray:{value.dtype.str}:{value.shape}:".encode())
        # As raw bytes: a memoryview of a float array has a format blake3 does not take.
        hasher.update(memoryview(np.ascontiguousarray(value)).cast("B"))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        hasher.update(b"bytes:")
        hasher.update(value)
    elif isinstance(value, (list, tuple)):
        hasher.update(f"seq:{len(value)}:".encode())
        for element in value:
            _feed(hasher, element)
    else:
        hasher.update(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))


def item_identifier(model_id: str, modality: str, content: Any, processor_kwargs: dict) -> str:
    hasher = blake3()
    _feed(hasher, {"model": model_id, "modality": modality, "kwargs": processor_kwargs})
    _feed(hasher, content)
    return hasher.hexdigest()
