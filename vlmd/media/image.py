"""Decode image bytes into a fully loaded RGB PIL image, under a MediaPolicy.

Pixels are kept as stored (no EXIF transpose) and converted with a plain ``convert("RGB")``,
as transformers' ``convert_rgb`` does, so images reach the processor exactly as they would
through transformers itself.
"""

from __future__ import annotations

import io
import threading
from contextlib import contextmanager

from PIL import Image, UnidentifiedImageError

from vlmd.errors import MediaError
from vlmd.media.fetch import fetch_bytes
from vlmd.media.policy import MediaPolicy

# Formats clients send in practice. Restricting Image.open keeps rarely exercised decoders
# (and EPS, which runs Ghostscript) away from untrusted bytes. JPEG also opens MPO (phones).
_WANTED_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "AVIF")
ALLOWED_FORMATS = tuple(f for f in _WANTED_FORMATS if f in Image.registered_extensions().values())


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Return ``data`` decoded as an RGB image with its pixels loaded, or raise MediaError."""
    if not data:
        raise MediaError("image data is empty")
    try:
        # Image.open reads only the header: the size checks below run before any pixel is
        # decoded, so a small file that declares a huge image is refused without allocating.
        img = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except UnidentifiedImageError:
        raise MediaError(
            f"cannot identify image data; supported formats: {', '.join(ALLOWED_FORMATS)}"
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # PIL's own global limit, reached when the policy allows more than PIL does.
        raise MediaError(_too_many_pixels_message(None, policy)) from None
    except Exception as exc:  # a malformed header can raise almost anything from a plugin
        raise MediaError(f"invalid image data: {_reason(exc)}") from None
    with img:
        width, height = img.size
        if width * height > policy.max_image_pixels:
            raise MediaError(_too_many_pixels_message(img.size, policy))
        side = policy.min_image_side
        if width < side or height < side:
            raise MediaError(
                f"image is too small: {width}x{height}; the minimum is {side}x{side}"
            )
        ratio = max(width, height) / min(width, height)
        if ratio > policy.max_image_aspect_ratio:
            raise MediaError(
                f"image aspect ratio is too extreme: {width}x{height} is {ratio:.0f}:1; "
                f"the limit is {policy.max_image_aspect_ratio:g}:1"
            )
        try:
            with DECODED_PIXELS.decoding(width * height):
                img.load()  # decode now, so a truncated file fails here and not in a worker
                return to_rgb(img)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise MediaError(_too_many_pixels_message(img.size, policy)) from None
        except Exception as exc:  # truncated or corrupt data: OSError, SyntaxError, ...
            raise MediaError(f"cannot decode {img.format} image: {_reason(exc)}") from None


class DecodedPixels:
    """The pixels of the image decodes this process has begun and finished, on any thread.

    A request that waits (for a preprocessing thread, or for the event loop to take its
    result back) reads ``begun`` when its wait starts and ``finished`` when it ends: what
    ``finished`` grew past ``begun`` is, at least, the pixels of decodes that began and ended
    inside its wait, so a request that waited behind a whole image's decode shows it as a
    count (``PreprocessStages.pixels_waited``, D116), whatever the host's speed."""

    def __init__(self):
        self._lock = threading.Lock()  # two threads' ``+=`` could lose one's pixels
        self.begun = 0
        self.finished = 0

    @contextmanager
    def decoding(self, pixels: int):
        with self._lock:
            self.begun += pixels
        try:
            yield
        finally:
            with self._lock:
                self.finished += pixels


DECODED_PIXELS = DecodedPixels()


def header_size(data: bytes) -> tuple[int, int] | None:
    """An image's (width, height) from its header alone (no pixel decoded), or None when the
    header cannot be read (the decode then says why)."""
    try:
        with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as img:
            return img.size
    except Exception:  # a malformed header can raise almost anything from a plugin
        return None


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB as transformers' ``convert_rgb`` makes it: transparency is composited onto
    white (not dropped), so our pixels equal the reference processor's."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    """Fetch ``url`` (data:, http(s)://, file://) and decode it; blocking, run off the loop."""
    return decode_image(fetch_bytes(url, policy), policy)


def _too_many_pixels_message(size: tuple[int, int] | None, policy: MediaPolicy) -> str:
    dims = f" ({size[0]}x{size[1]})" if size else ""
    return f"image is too large{dims}: the limit is {policy.max_image_pixels} pixels"


def _reason(exc: Exception) -> str:
    # PIL messages are short and path-free for in-memory data; fall back to the type name.
    text = str(exc).strip()
    return text[:200] if text else type(exc).__name__
