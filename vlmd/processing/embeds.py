"""Precomputed encoder outputs in a request: vLLM's ``image_embeds`` content part.

A client that ran the vision encoder elsewhere sends its output instead of the image:
``{"type": "image_embeds", "image_embeds": BASE64}``, where the base64 holds a tensor
written by ``torch.save`` (vLLM's format, what vLLM's clients send), of shape
``[placeholders, width]`` (or ``[1, placeholders, width]``): one vector per placeholder the
image would have taken, each of the width the model's encoder emits. The item then takes
the place an image takes, its output stored as an encoder server's is (``encoder_output``),
and the encoder never runs for it (docs/decisions.md, D103).

Everything is checked before the model sees it: the base64's size against the most an item
can hold (``max_model_len`` vectors of the model's width) before anything is decoded; the
bytes are torch's zip format, read by ``torch.load(weights_only=True)`` (torch's restricted
unpickler: tensors and plain containers only, no code), the one unpickling in vlmd; one
dense floating tensor of the right shape, finite. Every failure is a 400 that says which.

Families take embeddings where an image's place in the prompt does not depend on the image:
every image costs the same tokens whatever its size (LLaVA-1.5), and there is no
cross-attention. Where the layout follows the image (Qwen2-VL's grid, tiles), embeddings
alone do not say where their vectors go, and the part is a 400.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

from vlmd.errors import BadRequestError
from vlmd.types import MultiModalItem

# torch.save's archive is a zip file (the legacy raw-pickle format is refused).
_ZIP_MAGIC = b"PK\x03\x04"
# Bytes beside the tensor's data in a torch.save archive (its pickle, names, alignment).
_ARCHIVE_SLACK_BYTES = 64 << 10
# Two sizes an item's cost is compared at (see ``BaseMultiModalProcessor.embeds_template``).
SIZE_PROBES = ((224, 224), (1344, 896))


@dataclass(frozen=True)
class ImageEmbeds:
    """An image given as its encoder output: a float32 torch tensor ``[placeholders, width]``,
    checked. (This module imports torch only to read one: the processing modules that name
    these stay torch-free, as the front end's are.)"""

    vectors: Any

    @property
    def nbytes(self) -> int:  # what it holds while the request is processed (the media lease)
        return self.vectors.numel() * self.vectors.element_size()


@dataclass
class PrecomputedItem(MultiModalItem):
    """An item whose encoder output came with the request. It has no encoder inputs, so
    nothing could compute the output again: where the runner lets go of an encoder
    server's output once it has stored it (it can re-encode one evicted later), this item
    keeps its own (``precomputed``), so a request preempted after its output was evicted
    stores it again instead of asking an encoder for it (on every tensor-parallel rank too: the
    step channel rebuilds it as this class)."""

    precomputed: Any = None

    @property
    def encoder_output(self) -> Any:
        return self.precomputed

    @encoder_output.setter
    def encoder_output(self, value: Any) -> None:
        if value is not None:  # letting go (None) does not apply: see the class docstring
            self.precomputed = value


def decode_image_embeds(value: Any, where: str, width: int, max_rows: int) -> ImageEmbeds:
    """``image_embeds`` (base64 of ``torch.save(tensor)``) as checked float32 vectors of
    ``width`` values, at most ``max_rows`` of them."""
    if isinstance(value, dict):  # vLLM's other spelling: {"image_embeds": BASE64}
        unknown = sorted(set(value) - {"image_embeds"})
        if unknown:
            raise BadRequestError(
                f"{where}.image_embeds takes no {unknown[0]!r}: this model's images need their vectors only",
                param="messages")
        value = value.get("image_embeds")
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"{where}.image_embeds must be a base64 string of a tensor saved with torch.save",
                              param="messages")
    limit = max_rows * width * 4 + _ARCHIVE_SLACK_BYTES
    if len(value) > 4 * (limit + 2) // 3:
        raise BadRequestError(
            f"{where}.image_embeds holds more than {limit} bytes: an item has at most max_model_len ({max_rows}) "
            f"vectors of {width} values", param="messages")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError(f"{where}.image_embeds is not valid base64", param="messages") from None
    if not raw.startswith(_ZIP_MAGIC):
        raise BadRequestError(f"{where}.image_embeds is not a tensor saved with torch.save (a zip archive)",
                              param="messages")
    import torch

    try:
        loaded = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged or foreign archive: torch raises many kinds
        raise BadRequestError(f"{where}.image_embeds could not be read as a tensor ({type(exc).__name__})",
                              param="messages") from None
    return ImageEmbeds(_checked(loaded, where, width, max_rows))


def _checked(tensor: Any, where: str, width: int, max_rows: int) -> Any:
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        raise BadRequestError(f"{where}.image_embeds must hold one dense tensor, not {type(tensor).__name__}",
                              param="messages")
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise BadRequestError(f"{where}.image_embeds must be float32, float16 or bfloat16, not {tensor.dtype}",
                              param="messages")
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[1] != width or not 1 <= tensor.shape[0] <= max_rows:
        raise BadRequestError(
            f"{where}.image_embeds has shape {list(tensor.shape)}; this model takes [vectors, {width}] "
            f"(or [1, vectors, {width}]) with 1 to {max_rows} vectors", param="messages")
    vectors = tensor.to(torch.float32).contiguous()
    if not bool(torch.isfinite(vectors).all()):
        raise BadRequestError(f"{where}.image_embeds holds a value that is not finite (nan or inf)", param="messages")
    return vectors
