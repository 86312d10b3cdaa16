"""Decoded media by the client's own item ``uuid`` (vLLM's ``uuid`` on a content part): a
client that sent an item with its bytes once may send the uuid alone after.

Keyed by (modality, uuid) and holding the *decoded* item (a PIL image, a video's kept
frames, an audio clip at the model's rate), which depends on the bytes and the server's one
media policy only: an item served from here takes the rest of the path as if its bytes had
come again (its content identifier, then the processor, encoder and prefix caches, which
all key on content), so no family needs to know where its media came from. The uuid names
the content the last request that sent bytes with it had (as in vLLM, the client keeps its
uuids unique); an LRU bounded by decoded bytes, a part of the processor cache's budget.
"""

from __future__ import annotations

from typing import Any

from vlmd.media.budget import decoded_nbytes
from vlmd.media.byte_lru import ByteLRU

# The longest uuid taken (vLLM sets none): the key is kept while the item is.
MAX_UUID_CHARS = 256


class MediaByUuid(ByteLRU[tuple[str, str], Any]):
    def remember(self, modality: str, uuid: str, media: Any) -> None:
        self.put_sized((modality, uuid), media, decoded_nbytes(media))

    def recall(self, modality: str, uuid: str) -> Any | None:
        return self.get((modality, uuid))
