"""The Gemma 4 model: transformers' vision tower and embedder, our text decoder (``decoder.py``).

The tower needs no KV cache, so it is transformers' ``Gemma4VisionModel`` (2-D RoPE and a
learned position table over an image's patches, which attend to each other both ways; k x k
average pooling by patch position; standardization) and ``Gemma4MultimodalEmbedder`` (an
unscaled RMSNorm and a projection into the text width), built from the checkpoint's config.
Each image is encoded alone over its own patches: transformers pads every image to its
budget's patch count and masks the padding out of attention and pooling, which computes the
same vectors. An image token's embedding row is its tower output; its per-layer part is the
pad token's (``merge_multimodal``; the decoder's module docstring says why). Where the config
says ``use_bidirectional_attention="vision"`` an image's soft tokens attend to each other
both ways on the sliding layers (``attention_spans``; the full layers stay causal; audio
soft tokens never do). Where the config has an ``audio_config`` (E2B, E4B) the audio tower
and its embedder are ours (``audio.py``), in ``audio.tower_dtype`` of the server's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vlmd.layers.linear import SINGLE, TPGroup, adopt_linear_modules
from vlmd.models.base import ModelCapabilities
from vlmd.models.loader import WeightNames, iterate_weights, load_multimodal_weights
from vlmd.types import MultiModalItem
from vlmd_gemma4 import audio
from vlmd_gemma4.decoder import Gemma4TextModel

# Checkpoint prefixes (transformers 5's Gemma4ForConditionalGeneration) -> ours, first match
# wins (vlmd/models/loader.py, D108).
WEIGHT_NAMES = WeightNames("Gemma 4", (
    ("model.language_model.", "language_model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.embed_vision.", "embed_vision."),
    ("model.audio_tower.", "audio_tower."),
    ("model.embed_audio.", "embed_audio."),
))


def patches_of(pixels: torch.Tensor, patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An image's [H, W, 3] uint8 pixels as transformers' processor gives them to the tower:
    [patches, patch_size**2 * 3] values in [0, 1] (rescaled in float64, then float32) in
    row-major patch order, each patch's pixels row by row, channels last; and each patch's
    (x, y) position."""
    height, width, _ = pixels.shape
    rows, columns = height // patch_size, width // patch_size
    scaled = (pixels.to(torch.float64) * (1 / 255)).to(torch.float32).permute(2, 0, 1)
    patches = scaled.reshape(3, rows, patch_size, columns, patch_size).permute(1, 3, 2, 4, 0)
    x, y = torch.meshgrid(torch.arange(columns), torch.arange(rows), indexing="xy")
    positions = torch.stack([x, y], dim=-1).reshape(rows * columns, 2)
    return patches.reshape(rows * columns, -1), positions


class Gemma4Model(nn.Module):
    """Under tensor parallelism the decoder is sharded; the tower and embedder are
    replicated: every rank encodes every image."""

    capabilities = ModelCapabilities(merge_multimodal=True, drop_encoders=True, attention_spans=True)

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        text = config.text_config
        self.vision_tower = self.embed_vision = None
        if config.vision_config is not None:
            from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel

            vision_config = config.vision_config
            vision_config._attn_implementation = "sdpa"
            self.vision_tower = Gemma4VisionModel(vision_config)
            adopt_linear_modules(self.vision_tower)  # its linears on the seam (adopt.py), as every tower's
            self.embed_vision = Gemma4MultimodalEmbedder(vision_config, text)
        self.audio_tower = self.embed_audio = None
        if config.audio_config is not None:
            self.audio_tower = audio.Gemma4AudioTower(config.audio_config)
            self.embed_audio = audio.Gemma4AudioEmbedder(config.audio_config, text)
        # An image's soft tokens see each other both ways (on the sliding layers) where the config says so.
        self.bidirectional_images = text.use_bidirectional_attention == "vision"
        tied = bool(getattr(config, "tie_word_embeddings", True))
        self.language_model = Gemma4TextModel(text, tp, tie_word_embeddings=tied)
        self.kv_spec = self.language_model.kv_spec

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype, tp: TPGroup = SINGLE) -> "Gemma4Model":
        model = cls(config, tp)
        model.load_weights(iterate_weights(model_dir))
        for name, module in model.named_children():  # the audio tower in its own dtype (audio.py)
            module.to(audio.tower_dtype(dtype) if name in ("audio_tower", "embed_audio") else dtype)
        return model.eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        encoder_params = {}
        for prefix, module in (("vision_tower.", self.vision_tower), ("embed_vision.", self.embed_vision)):
            if module is not None:
                encoder_params.update({prefix + name: p for name, p in module.named_parameters()})
                # The tower's standardization (std_bias, std_scale) is a pair of checkpoint buffers.
                encoder_params.update({prefix + name: b for name, b in module.named_buffers()
                                       if name.startswith("std_")})
        for prefix, module in (("audio_tower.", self.audio_tower), ("embed_audio.", self.embed_audio)):
            if module is not None:  # the linears' clamp bounds are checkpoint buffers
                encoder_params.update({prefix + name: t for name, t in module.state_dict(keep_vars=True).items()})
        load_multimodal_weights(weights, WEIGHT_NAMES, encoder_params, self.language_model)

    # ---- the runner's contract -----------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def drop_encoders(self, modalities: set[str]) -> list[str]:
        dropped = []
        if "image" in modalities and self.vision_tower is not None:
            self.vision_tower = self.embed_vision = None
            dropped += ["vision_tower", "embed_vision"]
        if "audio" in modalities and self.audio_tower is not None:
            self.audio_tower = self.embed_audio = None
            dropped += ["audio_tower", "embed_audio"]
        return dropped

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each image through the tower alone (module docstring): [soft tokens, text hidden]."""
        if modality == "audio":
            return self.embed_audio_clips(encoder_inputs)
        if modality != "image":
            raise ValueError(f"Gemma 4 does not encode {modality} yet")
        if self.vision_tower is None:
            raise ValueError("this Gemma 4's vision tower is off (--limit-mm-per-prompt image=0)")
        device = self.language_model.embed_tokens.weight.device
        dtype = next(self.vision_tower.parameters()).dtype
        outputs = []
        for inputs in encoder_inputs:
            pixels = torch.from_numpy(np.ascontiguousarray(inputs["pixels"])).to(device)
            patches, positions = patches_of(pixels, int(inputs["patch_size"]))
            encoded = self.vision_tower(pixel_values=patches[None].to(dtype),
                                        pixel_position_ids=positions[None].to(device)).last_hidden_state
            outputs.append(self.embed_vision(encoded))
        return outputs

    def embed_audio_clips(self, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each clip's valid log-mel frames through the audio tower alone, in the decoder's dtype
        (what the encoder cache holds): [soft tokens, text hidden]."""
        if self.audio_tower is None:
            raise ValueError("this Gemma 4 has no audio tower (or it is off: --limit-mm-per-prompt audio=0)")
        device = self.language_model.embed_tokens.weight.device
        dtype = self.language_model.embed_tokens.weight.dtype
        return [self.embed_audio(self.audio_tower(torch.from_numpy(np.ascontiguousarray(inputs["input_features"])).to(device))).to(dtype)
                for inputs in encoder_inputs]

    def merge_multimodal(self, inputs_embeds: torch.Tensor, rows: torch.Tensor, features: torch.Tensor) -> None:
        """Image and audio rows: the tower's vectors, and the pad token's per-layer embeddings."""
        hidden = self.language_model.hidden_size
        inputs_embeds[rows, :hidden] = features.to(inputs_embeds.dtype)
        if inputs_embeds.shape[1] > hidden:
            inputs_embeds[rows, hidden:] = self.language_model.pad_per_layer_embedding().to(inputs_embeds.dtype)
        return None

    def attention_spans(self, items: list[MultiModalItem]) -> list[tuple[int, int]]:
        """Each image's soft tokens (not its boundary tokens: transformers' mm_token_type_ids),
        where they attend both ways; none otherwise. Audio soft tokens stay causal (transformers
        marks only vision tokens)."""
        if not self.bidirectional_images:
            return []
        return [(item.offset, item.end) for item in items if item.modality != "audio"]

    def forward(self, inputs_embeds, positions, meta, kv_caches, outputs=None, multimodal=None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches, outputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
