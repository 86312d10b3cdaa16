"""The Gemma 4 model: our text decoder (``decoder.py``); text only so far.

A checkpoint's vision and audio towers (``vision_tower``, ``embed_vision``, ``audio_tower``,
``embed_audio``) are not built yet: their weights are passed over, and the processing info
offers no modality, so a request with an image or audio part is refused (400) before it
reaches the model (issue 45: the towers come next).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmd.layers.linear import SINGLE, TPGroup
from vlmd.models.base import ModelCapabilities
from vlmd.models.loader import iterate_weights, load_multimodal_weights
from vlmd_gemma4.decoder import Gemma4TextModel

# Checkpoint prefixes (transformers 5's Gemma4ForConditionalGeneration) -> ours, in order:
# the first that matches renames. A plain table, for the core's prefix-mapping loader.
WEIGHT_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.embed_vision.", "embed_vision."),
    ("model.audio_tower.", "audio_tower."),
    ("model.embed_audio.", "embed_audio."),
)
# Towers this family does not build yet (module docstring): their weights are passed over.
UNBUILT_TOWERS = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")


def _rename(name: str) -> str:
    for old, new in WEIGHT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    raise ValueError(f"unexpected weight {name!r} in Gemma 4 checkpoint")


class Gemma4Model(nn.Module):
    capabilities = ModelCapabilities()

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        text = config.text_config
        tied = bool(getattr(config, "tie_word_embeddings", True))
        self.language_model = Gemma4TextModel(text, tp, tie_word_embeddings=tied)
        self.kv_spec = self.language_model.kv_spec

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype, tp: TPGroup = SINGLE) -> "Gemma4Model":
        model = cls(config, tp)
        model.load_weights(iterate_weights(model_dir))
        return model.to(dtype).eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_multimodal_weights(weights, _rename, {}, self.language_model, "Gemma 4",
                                skip=lambda target: target.startswith(UNBUILT_TOWERS))

    # ---- the runner's contract -----------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        raise ValueError(f"this Gemma 4 does not encode {modality} yet (text only)")

    def forward(self, inputs_embeds, positions, meta, kv_caches, outputs=None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches, outputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
