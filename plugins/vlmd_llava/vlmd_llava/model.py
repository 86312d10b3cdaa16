"""The LLaVA-1.5 model: transformers' CLIP vision tower, our projector and our Llama."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vlmd.layers.attention.towers import TOWER_ATTENTION
from vlmd.layers.linear import SINGLE, ReplicatedLinear, TPGroup, adopt_linear_modules
from vlmd.models.base import ModelCapabilities
from vlmd.models.llama import LlamaForCausalLM
from vlmd.models.loader import WeightNames, iterate_weights, load_multimodal_weights
from vlmd_llava.processing import CLIP_MEAN, CLIP_STD, image_processor_config

# Checkpoint prefixes (transformers 4.x, 5.x, and published LLaVA-1.5 layouts) -> ours.
WEIGHT_NAMES = WeightNames("LLaVA", (
    ("model.language_model.", "language_model.model."),
    ("language_model.model.", "language_model.model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
))


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str):
        super().__init__()
        # Our linear seam: it runs once per image over 576 rows, a product worth a kernel choice.
        self.linear_1 = ReplicatedLinear(vision_hidden, text_hidden)
        self.act = nn.GELU(approximate="tanh" if act == "gelu_pytorch_tanh" else "none")
        self.linear_2 = ReplicatedLinear(text_hidden, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaModel(nn.Module):
    """Under tensor parallelism (``tp``) the Llama is sharded; the CLIP tower and projector are
    replicated: every rank encodes every image (docs/architecture.md, "Tensor parallelism")."""

    capabilities = ModelCapabilities(drop_encoders=True)

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        from transformers import CLIPVisionModel

        self.config = config
        vision_config = config.vision_config
        # transformers' SDPA, but bfloat16 images by AVX512-BF16 where the host has it.
        vision_config._attn_implementation = TOWER_ATTENTION
        feature_layer = config.vision_feature_layer
        if not isinstance(feature_layer, int):
            raise ValueError(f"vision_feature_layer {feature_layer!r} is not supported (an int is)")
        num_layers = vision_config.num_hidden_layers
        # hidden_states[k] is the output of layer k (0 = embeddings): later layers never run.
        self.num_vision_layers = feature_layer % (num_layers + 1)
        tower = CLIPVisionModel(vision_config)
        # transformers 4.x wraps the tower in `.vision_model`; 5.x does not.
        self.vision_tower = getattr(tower, "vision_model", tower)
        self.vision_tower.encoder.layers = self.vision_tower.encoder.layers[: self.num_vision_layers]
        # The tower's products get measured kernels like the decoder's (CLIP only calls them).
        adopt_linear_modules(self.vision_tower)
        self.keep_cls = getattr(config, "vision_feature_select_strategy", "default") != "default"
        self.multi_modal_projector = LlavaProjector(
            vision_config.hidden_size, config.text_config.hidden_size, config.projector_hidden_act
        )
        self.language_model = LlamaForCausalLM(config.text_config, tp=tp)
        self.kv_spec = self.language_model.kv_spec

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype, tp: TPGroup = SINGLE) -> "LlavaModel":
        model = cls(config, tp)
        settings = image_processor_config(str(model_dir))
        model.register_buffer("pixel_mean", torch.tensor(settings.get("image_mean", CLIP_MEAN)).view(1, 3, 1, 1), persistent=False)
        model.register_buffer("pixel_std", torch.tensor(settings.get("image_std", CLIP_STD)).view(1, 3, 1, 1), persistent=False)
        model.load_weights(iterate_weights(model_dir))
        return model.to(dtype).eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = {name: p for name, p in self.named_parameters() if not name.startswith("language_model.")}
        load_multimodal_weights(weights, WEIGHT_NAMES, params, self.language_model, not_built=self._never_built)

    def _never_built(self, target: str) -> bool:
        """Tower layers past the feature layer and the final layer norm are never run."""
        if target.startswith("vision_tower.encoder.layers."):
            return int(target.split(".")[3]) >= self.num_vision_layers
        return target.startswith("vision_tower.post_layernorm.")

    def drop_encoders(self, modalities: set[str]) -> list[str]:
        """--limit-mm-per-prompt image=0: the vision tower and projector are never needed."""
        if "image" not in modalities:
            return []
        self.vision_tower = None
        self.multi_modal_projector = None
        return ["vision_tower", "multi_modal_projector"]

    # ---- the runner's contract -----------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        if modality != "image" or self.vision_tower is None:
            raise ValueError(f"this LLaVA does not encode {modality} (its encoder is off: --limit-mm-per-prompt)")
        # uint8 travels to the device as uint8 (a quarter of float32's bytes).
        pixels = torch.from_numpy(np.stack([inputs["pixels"] for inputs in encoder_inputs])).to(self.pixel_mean.device)
        dtype = self.pixel_mean.dtype
        # uint8 -> normalised float in one fused expression (rescale, subtract, divide).
        pixel_values = (pixels.to(torch.float32) / 255.0 - self.pixel_mean.float()) / self.pixel_std.float()
        tower = self.vision_tower
        hidden = tower.pre_layrnorm(tower.embeddings(pixel_values.to(dtype)))
        hidden = tower.encoder(inputs_embeds=hidden).last_hidden_state
        if not self.keep_cls:
            hidden = hidden[:, 1:]
        projected = self.multi_modal_projector(hidden)
        return list(projected.unbind(0))

    def forward(self, inputs_embeds, positions, meta, kv_caches, outputs=None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches, outputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
