"""The decoded-image memo (vlmd/media/decoded_images.py): one decode per distinct upload,
bounded by decoded bytes, least recently used out first."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

from PIL import Image

from vlmd.media.decoded_images import DecodedImages, image_nbytes


def _png(seed: int, size=(16, 16)) -> bytes:
    image = Image.new("RGB", size, (seed % 256, (seed * 7) % 256, (seed * 13) % 256))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class CountingDecoder:
    def __init__(self):
        self.calls = 0

    def __call__(self, data: bytes) -> Image.Image:
        self.calls += 1
        return Image.open(io.BytesIO(data)).convert("RGB")


def test_the_same_bytes_are_decoded_once_and_other_bytes_again():
    memo, decode = DecodedImages(1 << 20), CountingDecoder()
    first = memo.decode(_png(1), decode)
    again = memo.decode(_png(1), decode)
    other = memo.decode(_png(2), decode)
    assert decode.calls == 2 and again is first and other is not first
    assert first.getpixel((0, 0)) == (1, 7, 13) and other.getpixel((0, 0)) == (2, 14, 26)
    assert (memo.queries, memo.hits) == (3, 1)
    assert memo.nbytes == 2 * image_nbytes(first)


def test_bounded_by_decoded_bytes_least_recently_used_out():
    one = 16 * 16 * 3
    memo, decode = DecodedImages(2 * one), CountingDecoder()
    memo.decode(_png(1), decode)
    memo.decode(_png(2), decode)
    memo.decode(_png(1), decode)  # 1 is now the most recent
    memo.decode(_png(3), decode)  # evicts 2
    assert memo.nbytes == 2 * one and decode.calls == 3
    memo.decode(_png(1), decode)
    assert decode.calls == 3
    memo.decode(_png(2), decode)
    assert decode.calls == 4


def test_an_image_larger_than_the_memo_is_not_kept():
    memo, decode = DecodedImages(100), CountingDecoder()
    memo.decode(_png(1), decode)
    memo.decode(_png(1), decode)
    assert decode.calls == 2 and memo.nbytes == 0


def test_concurrent_uploads_of_one_image_get_equal_pixels():
    memo, decode = DecodedImages(1 << 20), CountingDecoder()
    data = _png(5, (64, 48))
    with ThreadPoolExecutor(8) as pool:
        images = list(pool.map(lambda _: memo.decode(data, decode), range(32)))
    assert all(image.tobytes() == images[0].tobytes() for image in images)
    assert memo.nbytes == 64 * 48 * 3  # kept once, however many threads decoded it first
