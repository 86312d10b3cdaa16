"""Qwen3.5 media processing: Qwen3-VL's, item for item.

Qwen3.5 checkpoints name transformers' ``Qwen3VLProcessor`` (images through
``Qwen2VLImageProcessor``, video through ``Qwen3VLVideoProcessor``), and
``Qwen3_5Model.get_rope_index`` gives a video's frame pairs, each under its timestamp, the
positions Qwen3-VL's does: so sizes, token counts, the video layout and the M-RoPE table are
``vlmd_qwen3_vl``'s code. What differs is the decoder: no DeepStack (an encoder row is one
vector of the decoder's width) and a KV model with a recurrent state per linear-attention
layer (``kv.py``); the processor and dummy inputs are Qwen3-VL's classes.
"""

from __future__ import annotations

from vlmd.types import KVSpec
from vlmd_qwen3_5.kv import kv_spec_for
from vlmd_qwen3_vl.processing import Qwen3VLProcessingInfo

__all__ = ["Qwen3_5ProcessingInfo"]


class Qwen3_5ProcessingInfo(Qwen3VLProcessingInfo):
    def encoder_output_width(self) -> int:
        """One vector of the decoder's width per placeholder (no DeepStack)."""
        return int(self.ctx.hf_config.text_config.hidden_size)

    def kv_spec(self) -> KVSpec:
        """Every decoder layer, the full-attention ones paged, each linear-attention one its
        recurrent state's bytes."""
        return kv_spec_for(self.ctx.hf_config.text_config)

