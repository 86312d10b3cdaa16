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

from collections.abc import Callable

from blake3 import blake3
from PIL import Image

from vlmd.media.byte_lru import ByteLRU


def image_nbytes(image: Image.Image) -> int:
    return image.width * image.height * len(image.getbands())


class DecodedImages(ByteLRU[bytes, Image.Image]):
    def decode(self, data: bytes, decode: Callable[[bytes], Image.Image]) -> Image.Image:
        """The image ``decode(data)`` returns, decoded only if these bytes were not seen."""
        key = blake3(data).digest()
        image = self.get(key)
        if image is None:
            image = decode(data)  # unlocked: other threads decode other images meanwhile
            self.put_sized(key, image, image_nbytes(image))
        return image
