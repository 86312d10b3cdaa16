"""The processor cache: processed media items by identifier, an LRU bounded by bytes.

Lives on the front end and is shared by the preprocessing threads, hence the lock. The
identifier covers model, modality, content with size/mode, and processor kwargs, so a hit
is always the same work done before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vlmd.media.byte_lru import ByteLRU
from vlmd.media.by_uuid import MediaByUuid
from vlmd.media.decoded_images import DecodedImages
from vlmd.processing.base import ProcessedItem


def item_nbytes(item: ProcessedItem) -> int:
    total = 8 * len(item.replacement)
    for value in item.encoder_inputs.values():
        total += value.nbytes if isinstance(value, np.ndarray) else _generic_size(value)
    return total


def _generic_size(value: Any) -> int:
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(value, (list, tuple)):
        return sum(_generic_size(v) for v in value)
    return 64


# The decoded-image memo's share of the processor cache's budget: a sixteenth, at most
# 64 MiB (~70 decoded 640x480 images), enough for the images of the chats in flight.
DECODED_IMAGES_SHARE = 16
DECODED_IMAGES_MAX_BYTES = 64 << 20
# Media kept by their client uuid (vlmd/media/by_uuid.py): another sixteenth, at most
# 256 MiB (a few dozen decoded videos, hundreds of images).
MEDIA_BY_UUID_SHARE = 16
MEDIA_BY_UUID_MAX_BYTES = 256 << 20


class ProcessorCache(ByteLRU[str, ProcessedItem]):
    def __init__(self, capacity_bytes: int):
        memo_bytes = min(DECODED_IMAGES_MAX_BYTES, capacity_bytes // DECODED_IMAGES_SHARE)
        by_uuid_bytes = min(MEDIA_BY_UUID_MAX_BYTES, capacity_bytes // MEDIA_BY_UUID_SHARE)
        super().__init__(capacity_bytes - memo_bytes - by_uuid_bytes)
        # Decoded uploads by their encoded bytes (vlmd/media/decoded_images.py) and decoded
        # items by their client uuid (vlmd/media/by_uuid.py), inside this cache's budget:
        # the memory plan counts --mm-processor-cache-gb once.
        self.decoded_images = DecodedImages(memo_bytes)
        self.by_uuid = MediaByUuid(by_uuid_bytes)

    def put(self, identifier: str, item: ProcessedItem) -> None:
        self.put_sized(identifier, item, item_nbytes(item))
