"""The processor cache: processed media items by identifier, an LRU bounded by bytes.

Lives on the front end and is shared by the preprocessing threads, hence the lock. The
identifier covers model, modality, content with size/mode, and processor kwargs, so a hit
is always the same work done before.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

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


class ProcessorCache:
    def __init__(self, capacity_bytes: int):
        memo_bytes = min(DECODED_IMAGES_MAX_BYTES, capacity_bytes // DECODED_IMAGES_SHARE)
        # Decoded uploads by their encoded bytes (vlmd/media/decoded_images.py), inside this
        # cache's budget: the memory plan counts --mm-processor-cache-gb once.
        self.decoded_images = DecodedImages(memo_bytes)
        self.capacity_bytes = capacity_bytes - memo_bytes
        self._items: OrderedDict[str, tuple[ProcessedItem, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.queries = 0
        self.hits = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, identifier: str) -> ProcessedItem | None:
        with self._lock:
            self.queries += 1
            entry = self._items.get(identifier)
            if entry is None:
                return None
            self._items.move_to_end(identifier)
            self.hits += 1
            return entry[0]

    def put(self, identifier: str, item: ProcessedItem) -> None:
        size = item_nbytes(item)
        if size > self.capacity_bytes:
            return  # larger than the whole cache: keeping it would evict everything
        with self._lock:
            previous = self._items.pop(identifier, None)
            if previous is not None:
                self._bytes -= previous[1]
            self._items[identifier] = (item, size)
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, (_, evicted) = self._items.popitem(last=False)
                self._bytes -= evicted
