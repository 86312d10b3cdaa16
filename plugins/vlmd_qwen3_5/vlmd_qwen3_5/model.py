"""The Qwen3.5 model, dense and mixture-of-experts: transformers' vision tower and our hybrid
decoder (``decoder.py``).

The vision tower needs no KV cache, so it is transformers' own ``Qwen3_5VisionModel`` (Qwen3-VL's
tower without DeepStack: 16-px patches of frame pairs, learned positions interpolated to
each grid, 2D RoPE, a 2x2 merger), fed and split into items by Qwen3-VL's code
(``vlmd_qwen3_vl.model.VisionItems``): one row of the decoder's width per placeholder, a
video's timestamp text between its frame pairs. Positions are Qwen3-VL's M-RoPE table
(``vlmd_qwen3_vl.positions``), which ``Qwen3_5Model.get_rope_index`` equals.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmd.layers.attention.towers import TOWER_ATTENTION
from vlmd.layers.linear import SINGLE, TPGroup, adopt_linear_modules
from vlmd.models.base import ModelCapabilities
from vlmd.models.loader import SKIP, WeightNames
from vlmd_qwen3_5.decoder import Qwen3_5ForCausalLM
from vlmd_qwen3_vl.model import VisionItems
from vlmd_qwen3_vl.settings import VisionSettings

# Checkpoint names (transformers 5 layout, as published) -> ours. The multi-token
# prediction head (``mtp.``) of published checkpoints serves speculative decoding, which
# vlmd does not do: its weights are read past (D107).
WEIGHT_NAMES = WeightNames("Qwen3.5", (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
    ("mtp.", SKIP),
))


def _vision_model_class(config) -> type:
    """transformers' tower for this config: the MoE checkpoints' is the same module under
    its own config class."""
    if type(config).__name__ == "Qwen3_5MoeConfig":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

        return Qwen3_5MoeVisionModel
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    return Qwen3_5VisionModel


class Qwen3_5Model(VisionItems, nn.Module):
    """Under tensor parallelism (``tp``) the decoder is sharded; the vision tower is
    replicated: every rank encodes every image (docs/architecture.md)."""

    weight_names = WEIGHT_NAMES
    capabilities = ModelCapabilities(slice_positions=True, drop_encoders=True)
    family_name = "Qwen3.5"

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        vision_config, text_config = config.vision_config, config.text_config
        vision_config._attn_implementation = TOWER_ATTENTION  # SDPA; bfloat16 by AVX512-BF16 (D118)
        self.visual = _vision_model_class(config)(vision_config)
        adopt_linear_modules(self.visual)
        self.encoder_output_width = int(text_config.hidden_size)
        if int(vision_config.out_hidden_size) != self.encoder_output_width:
            raise ValueError(f"vision out_hidden_size {vision_config.out_hidden_size} is not the decoder's "
                             f"hidden size {self.encoder_output_width}")
        self.language_model = Qwen3_5ForCausalLM(
            text_config, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)), tp=tp)
        self.kv_spec = self.language_model.kv_spec
        self.settings: dict[str, VisionSettings] = {}

    # ---- the runner's contract -----------------------------------------------------

    def tower_rows(self, out) -> torch.Tensor:
        """Each placeholder's row: the merged vector alone."""
        return out.pooler_output

    def forward(self, inputs_embeds, positions, meta, kv_caches, outputs=None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches, outputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
