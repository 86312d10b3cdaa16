"""Gemma 4's vision tower under pre-packed linear kernels encodes an image as with plain ones.

transformers' patch embedder reads its ``input_proj.weight`` (for its dtype) instead of only
calling the layer; a packed kernel drops the plain weight (``select_linear_kernels``), so that
layer must stay off the linear seam. The small checkpoint's 768x384 patch projection was
packed by measurement and its first image (the start-up profile's) failed; ``packed`` mode
packs every layer, the tiny one's too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlmd.layers.linear import select_linear_kernels
from vlmd.layers.linear.kernels import packing_available


@pytest.mark.skipif(not packing_available(torch.zeros(1)), reason="no oneDNN packing here")
def test_the_tower_encodes_the_same_with_every_linear_packed(tiny_gemma4_dir):
    from transformers import AutoConfig
    from vlmd_gemma4.model import Gemma4Model

    model = Gemma4Model.load(tiny_gemma4_dir, AutoConfig.from_pretrained(tiny_gemma4_dir), torch.float32)
    pixels = np.random.default_rng(0).integers(0, 256, size=(24, 36, 3), dtype=np.uint8)  # 6 x 9 patches of 4
    item = [{"pixels": pixels, "patch_size": 4}]
    with torch.inference_mode():
        plain = model.embed_multimodal("image", item)[0]
    select_linear_kernels(model, "packed")
    assert model.vision_tower.encoder.layers[0].mlp.down_proj.linear.kernel is not None  # the encoder's are packed
    with torch.inference_mode():
        packed = model.embed_multimodal("image", item)[0]
    assert plain.shape == (6, 64)  # 54 patches pooled 3 x 3, in the decoder's width
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
