"""The Gemma 3 model: transformers' SigLIP tower, the 4x4 average pool and projector, our decoder.

The tower needs no KV cache, so it is transformers' ``SiglipVisionModel`` built from the
checkpoint's vision config; the projector pools the tower's ``p x p`` patch grid to
``sqrt(mm_tokens_per_image)`` per side (4x4 in released checkpoints: 64 x 64 patches ->
256 tokens), RMS-norms it (``1 + w``) and projects it into the text width.

An item's placeholder run goes from its first image token to its last: with pan-and-scan it
holds the original image's tokens, then text ("and here are some crops ..."), then each
crop's. ``embed_multimodal`` returns the whole run, text rows as the decoder embeds them,
so the runner's one-vector-per-placeholder contract holds. Each image's tokens attend to
each other both ways (``attention_spans``), each crop on its own, as transformers builds
from ``token_type_ids``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vlmd.layers.attention.towers import TOWER_ATTENTION
from vlmd.layers.linear import SINGLE, TPGroup, adopt_linear_modules
from vlmd.models.base import ModelCapabilities
from vlmd.models.loader import WeightNames, iterate_weights, load_multimodal_weights
from vlmd.types import MultiModalItem
from vlmd_gemma3.decoder import Gemma3TextModel, GemmaRMSNorm
from vlmd_gemma3.settings import read_settings

# Checkpoint prefixes (transformers 5, and the published 4.x layout) -> ours.
WEIGHT_NAMES = WeightNames("Gemma 3", (
    ("model.language_model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
))


class Gemma3Projector(nn.Module):
    def __init__(self, config):
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, text.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.patches_per_side = int(vision.image_size // vision.patch_size)
        tokens_per_side = int(round(config.mm_tokens_per_image ** 0.5))
        if tokens_per_side ** 2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image} does not pool a "
                             f"{self.patches_per_side}x{self.patches_per_side} patch grid evenly")
        self.pool = nn.AvgPool2d(self.patches_per_side // tokens_per_side)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[images, p * p, vision hidden] -> [images, mm_tokens_per_image, text hidden]."""
        images, _, width = patches.shape
        grid = patches.transpose(1, 2).reshape(images, width, self.patches_per_side, self.patches_per_side)
        pooled = self.pool(grid.contiguous()).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(patches)


class Gemma3Model(nn.Module):
    """Under tensor parallelism the decoder is sharded; the tower and projector are
    replicated: every rank encodes every image."""

    capabilities = ModelCapabilities(attention_spans=True, drop_encoders=True)

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        from transformers import SiglipVisionModel

        self.config = config
        vision_config = config.vision_config
        vision_config._attn_implementation = TOWER_ATTENTION  # SDPA; bfloat16 by AVX512-BF16 (D118)
        self.vision_tower = SiglipVisionModel(vision_config)
        adopt_linear_modules(self.vision_tower)  # its linears on the seam (adopt.py), as every tower's
        self.multi_modal_projector = Gemma3Projector(config)
        tied = bool(getattr(config, "tie_word_embeddings", True))
        self.language_model = Gemma3TextModel(config.text_config, tp, tie_word_embeddings=tied)
        self.kv_spec = self.language_model.kv_spec

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype, tp: TPGroup = SINGLE) -> "Gemma3Model":
        model = cls(config, tp)
        model.load_weights(iterate_weights(model_dir))
        model = model.to(dtype).eval()
        settings = read_settings(str(model_dir))
        # Registered after the dtype cast: normalisation stays float32, as the reference's.
        model.register_buffer("image_mean", torch.tensor(settings.mean, dtype=torch.float32), persistent=False)
        model.register_buffer("image_std", torch.tensor(settings.std, dtype=torch.float32), persistent=False)
        return model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        encoder_params = {f"vision_tower.{name}": p for name, p in self.vision_tower.named_parameters()}
        encoder_params.update({f"multi_modal_projector.{name}": p
                               for name, p in self.multi_modal_projector.named_parameters()})
        load_multimodal_weights(weights, WEIGHT_NAMES, encoder_params, self.language_model)

    # ---- the runner's contract -----------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def drop_encoders(self, modalities: set[str]) -> list[str]:
        if "image" not in modalities:
            return []
        self.vision_tower = None
        return ["vision_tower"]

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One tower pass over every image and crop of the batch; each item's output is its
        whole placeholder run (image tokens from the tower, text between crops embedded)."""
        if self.vision_tower is None:
            raise ValueError("this Gemma 3's vision tower is off (--limit-mm-per-prompt image=0)")
        if modality != "image":
            raise ValueError(f"Gemma 3 does not encode {modality}")
        device = self.image_mean.device
        pixels = torch.cat([torch.from_numpy(np.asarray(inputs["pixels"])) for inputs in encoder_inputs]).to(device)
        # Rescale and normalise in float32, as the reference processor does.
        normed = (pixels.to(torch.float32) / 255.0 - self.image_mean.view(1, 3, 1, 1)) / self.image_std.view(1, 3, 1, 1)
        dtype = next(self.vision_tower.parameters()).dtype
        patches = self.vision_tower(pixel_values=normed.to(dtype)).last_hidden_state
        features = self.multi_modal_projector(patches)  # [images, tokens, hidden]
        outputs, image = [], 0
        for inputs in encoder_inputs:
            run = self.embed_input_ids(torch.as_tensor(inputs["run_ids"], dtype=torch.long, device=device))
            for first, end in inputs["spans"]:
                run[first:end] = features[image].to(run.dtype)
                image += 1
            outputs.append(run)
        return outputs

    def attention_spans(self, items: list[MultiModalItem]) -> list[tuple[int, int]]:
        """Each image's (and crop's) token positions: they attend to each other both ways."""
        return [(item.offset + first, item.offset + end) for item in items for first, end in item.encoder_inputs["spans"]]

    def forward(self, inputs_embeds, positions, meta, kv_caches, outputs=None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches, outputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
