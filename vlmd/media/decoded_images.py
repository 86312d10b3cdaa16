"""Decoded images by the blake3 of their encoded bytes: an upload sent again is decoded once.

A conversation resends its image with every turn, and a client may send one image with
many prompts. The processor cache cannot help before the image is decoded (its key hashes
the decoded pixels, with their size and mode), so every repeat paid a full decode on a
preprocessing thread, on the cores the engine steps on: at 8 concurrent chats of the tiny
LLaVA with one 640x480 JPEG, most of those threads' samples were in ``ImageFile.load``.

Decoding is a function of the bytes and of the server's one media policy, so a hit is the
image a decode would return. Entries are shared, read-only PIL images (the processors only
read them); the LRU is bounded by decoded bytes, a part of the processor cache's budget.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from blake3 import blake3
from PIL import Image


def image_nbytes(image: Image.Image) -> int:
    return image.width * image.height * len(image.getbands())


class DecodedImages:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._images: OrderedDict[bytes, tuple[Image.Image, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.queries = 0
        self.hits = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def decode(self, data: bytes, decode: Callable[[bytes], Image.Image]) -> Image.Image:
        """The image ``decode(data)`` returns, decoded only if these bytes were not seen."""
        key = blake3(data).digest()
        with self._lock:
            self.queries += 1
            entry = self._images.get(key)
            if entry is not None:
                self._images.move_to_end(key)
                self.hits += 1
                return entry[0]
        image = decode(data)  # outside the lock: other threads decode other images meanwhile
        size = image_nbytes(image)
        if size > self.capacity_bytes:
            return image  # larger than the whole memo: keeping it would evict everything
        with self._lock:
            if key not in self._images:
                self._images[key] = (image, size)
                self._bytes += size
                while self._bytes > self.capacity_bytes:
                    _, (_, evicted) = self._images.popitem(last=False)
                    self._bytes -= evicted
        return image
