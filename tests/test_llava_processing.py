"""Our LLaVA image preprocessing equals transformers' CLIP processor (PIL backend), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from oracle import load_hf_llava
from vlmd.media.image import to_rgb
from vlmd_llava.processing import CLIP_MEAN, CLIP_STD, resize_and_crop


def _images():
    rng = np.random.default_rng(0)
    sizes = [(640, 480), (480, 640), (1000, 337), (200, 100), (336, 336), (641, 479), (100, 2000)]
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    images.append(Image.fromarray(rng.integers(0, 255, (300, 400, 4), dtype=np.uint8), "RGBA"))
    images.append(Image.fromarray(rng.integers(0, 255, (300, 400), dtype=np.uint8), "L"))
    palette = Image.fromarray(rng.integers(0, 255, (300, 400), dtype=np.uint8), "L").convert("P")
    palette.info["transparency"] = 5
    images.append(palette)
    return images


@pytest.mark.parametrize("index", range(10))
def test_pixels_equal_transformers(tiny_llava_dir, index):
    image = _images()[index]
    _, processor = load_hf_llava(tiny_llava_dir)
    reference = processor.image_processor(image, return_tensors="pt")["pixel_values"][0]
    pixels = torch.from_numpy(resize_and_crop(to_rgb(image), 336, (336, 336), Image.BICUBIC))
    ours = (pixels.float() / 255.0 - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)
    assert torch.equal(ours, reference), f"{image.mode} {image.size}: max diff {(ours - reference).abs().max()}"
