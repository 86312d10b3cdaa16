"""The Qwen2.5-VL model: transformers' vision tower and our Qwen2, on Qwen2-VL's frame.

Everything but the tower is Qwen2-VL's (``vlmd_qwen2_vl.model``): the checkpoint layout,
on-device patchify of uint8 frames, the Qwen2 decoder over the paged cache (sharded under
tensor parallelism; the tower is replicated) and positions from the request's
``MRopeState``. The tower differs: most blocks attend within windows of
``window_size`` pixels (``fullatt_block_indexes`` attend across the whole frame pair), with
patches permuted into window order and the merged output permuted back, and its blocks use
RMSNorm and a SwiGLU MLP. That tower needs no KV cache, so it is transformers' own module
built from the checkpoint config, as Qwen2-VL's is.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from vlmd_qwen2_vl.model import WEIGHT_NAMES, Qwen2VLModel


class Qwen2_5_VLModel(Qwen2VLModel):
    weight_names = replace(WEIGHT_NAMES, family="Qwen2.5-VL")  # Qwen2-VL's table, errors naming Qwen2.5-VL

    @staticmethod
    def build_vision_tower(vision_config) -> nn.Module:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel(vision_config)

