"""The Llama 3.2 Vision model for the runner: transformers' vision tower, our text decoder.

Its decoder cross-attends (``ModelCapabilities.cross_attention_kv``): each image is an item
without placeholders (``processing.py``); the runner encodes all of a request's images with
its first chunk and asks :meth:`MllamaModel.prepare_request_cross_attention` once for the
request's cross-attention K/V, which it writes into the request's blocks of the cross pool
(held until the request is dropped); every step then hands them back per request as
``cross_states``, read through its table, with the request's layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmd.layers.linear import SINGLE, TPGroup
from vlmd.models.base import CrossAttentionKV, ModelCapabilities
from vlmd.models.loader import WeightNames, iterate_weights, load_into
from vlmd_mllama.decoder import CrossState, MllamaTextDecoder
from vlmd_mllama.layout import CrossLayout
from vlmd_mllama.tiles import read_tile_settings

# Checkpoint prefixes, transformers 5 and the published 4.x layout -> ours, under "text." (the
# decoder's parameters) or "vision." (the tower's, projector included).
WEIGHT_NAMES = WeightNames("Mllama", (
    ("model.language_model.", "text."),
    ("language_model.model.", "text."),
    ("language_model.lm_head.", "text.lm_head."),
    ("lm_head.", "text.lm_head."),
    ("model.vision_model.", "vision.vision_model."),
    ("vision_model.", "vision.vision_model."),
    ("model.multi_modal_projector.", "vision.multi_modal_projector."),
    ("multi_modal_projector.", "vision.multi_modal_projector."),
))
# checkpoint fragment -> (our fused parameter fragment, shard id for its weight_loader)
_FUSED = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
    ".cross_attn.k_proj.": (".cross_attn.kv_proj.", 0),
    ".cross_attn.v_proj.": (".cross_attn.kv_proj.", 1),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}


class MllamaModel(nn.Module):
    """Under tensor parallelism (``tp``) the text decoder is sharded by heads and columns; the
    vision tower and projector are replicated (every rank encodes every image)."""

    # The decoder cross-attends to all of a request's images at once, laid out by the family
    # state. Prefix caching stays on: block hashes name every image (items at offset 0), and
    # the first chunk after a prefix hit derives the cross-attention K/V again from the images.
    capabilities = ModelCapabilities(cross_attention_kv=CrossAttentionKV.FROM_REQUEST_ITEMS,
                                     cross_attention_prefix_caching=True)

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        from vlmd_mllama.vision import MllamaVisionTower

        self.config = config
        self.vision = MllamaVisionTower(config)
        self.language_model = MllamaTextDecoder(config.text_config, tp)
        self.language_model.max_tiles = self.vision.max_tiles
        self.language_model.tokens_per_tile = self.vision.tokens_per_tile
        self.kv_spec = self.language_model.kv_spec

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype, tp: TPGroup = SINGLE) -> "MllamaModel":
        model = cls(config, tp)
        model.load_weights(iterate_weights(model_dir))
        model = model.to(dtype).eval()
        model.vision.set_pixel_norm(read_tile_settings(str(model_dir), config))
        return model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.language_model.named_parameters())
        vision_params = dict(self.vision.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = WEIGHT_NAMES.target(name)
            if target is None:
                continue
            part, target = target.split(".", 1)
            shard = None
            if part == "text":
                for fragment, (fused, index) in _FUSED.items():
                    if fragment in f".{target}":
                        target, shard = f".{target}".replace(fragment, fused)[1:], index
                        break
                param = params.get(target)
            else:
                param = vision_params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in the Mllama checkpoint")
            load_into(param, tensor, name, shard)
            loaded.add(f"{part}:{target}")
        expected = {f"text:{n}" for n in params} | {f"vision:{n}" for n in vision_params}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the Mllama checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    # ---- the runner's contract -----------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        if modality != "image":
            raise ValueError(f"Llama 3.2 Vision does not encode {modality}")
        return self.vision(encoder_inputs)

    def prepare_request_cross_attention(self, encoder_outputs: list[torch.Tensor], family_state) -> CrossState:
        """The request's cross-attention K/V of every cross-attention layer, from all its
        images' tower outputs (in prompt order) and where their tokens sit."""
        if not isinstance(family_state, CrossLayout) or len(family_state.tiles) != len(encoder_outputs):
            raise RuntimeError(f"{len(encoder_outputs)} images reached the decoder without their layout")
        return self.language_model.cross_attention_state(torch.cat(encoder_outputs))

    def forward(self, inputs_embeds, positions, meta, kv_caches, cross_states, outputs=None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches, cross_states, outputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
