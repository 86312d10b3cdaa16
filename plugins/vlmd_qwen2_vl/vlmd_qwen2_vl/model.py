"""The Qwen2-VL model: transformers' vision tower (2D-RoPE ViT + 2x2 merger) and our Qwen2.

The vision tower needs no KV cache, so it is transformers' own module built from the
checkpoint config; the language model, where the paged cache lives, is ours (M-RoPE
positions come from the processor, see ``positions.py``). uint8 frames are rescaled,
normalised and cut into patches here, on the device, in the layout transformers' processors
produce: per frame pair, 2x2 blocks of 14-px patches, each patch ``[C, T=2, 14, 14]``.
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
from vlmd.models.qwen2 import Qwen2ForCausalLM
from vlmd_qwen2_vl.positions import MRopeState
from vlmd_qwen2_vl.settings import VisionSettings, read_settings

# Checkpoint prefixes (transformers 5 and 4.x layouts) -> ours.
WEIGHT_NAMES = WeightNames("Qwen2-VL", (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("visual.", "visual."),
    ("model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
))


def patchify(pixels: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, settings: VisionSettings) -> torch.Tensor:
    """uint8 ``[frames, 3, H, W]`` -> normalised float32 patches ``[t * h * w, 3 * T * p * p]``."""
    temporal, patch, merge = settings.temporal_patch_size, settings.patch_size, settings.merge_size
    if pad := -pixels.shape[0] % temporal:  # an odd last frame is repeated, as transformers does
        pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
    # Rescale and normalise in one expression, in float32 as the reference processor does.
    frames = (pixels.to(torch.float32) / 255.0 - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    num_frames, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = num_frames // temporal, height // patch, width // patch
    patches = frames.view(grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    # -> (t, h-block, w-block, h-in-block, w-in-block, C, T, p, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch)


class Qwen2VLModel(nn.Module):
    """Under tensor parallelism (``tp``) the Qwen2 decoder is sharded; the vision tower is
    replicated: every rank encodes every image and video (docs/architecture.md)."""

    capabilities = ModelCapabilities(slice_positions=True, drop_encoders=True)
    weight_names = WEIGHT_NAMES  # Qwen2.5-VL's checkpoints name their weights the same way

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        vision_config = config.vision_config
        # transformers' SDPA, but bfloat16 frames by AVX512-BF16 where the host has it (D118).
        vision_config._attn_implementation = TOWER_ATTENTION
        self.visual = self.build_vision_tower(vision_config)
        # The tower's linears on the seam (pre-packed oneDNN weights, timed at start-up): one
        # 640x480 image through the small Qwen2-VL's tower took 163 ms against 188 with plain
        # F.linear (2 threads, AMD EPYC family 25 model 17, Zen 4); the tower calls its
        # linears, never reads their weights on our path (adopt.py).
        adopt_linear_modules(self.visual)
        self.language_model = Qwen2ForCausalLM(
            config.text_config, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)), tp=tp
        )
        self.kv_spec = self.language_model.kv_spec
        self.settings: dict[str, VisionSettings] = {}

    @staticmethod
    def build_vision_tower(vision_config) -> nn.Module:
        """The tower: transformers' own module (a family with another tower overrides this)."""
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel(vision_config)

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype, tp: TPGroup = SINGLE) -> "Qwen2VLModel":
        model = cls(config, tp)
        model.load_weights(iterate_weights(model_dir))
        model = model.to(dtype).eval()
        # Registered after the dtype cast: normalisation stays float32, as the reference's.
        for modality in ("image", "video"):
            settings = read_settings(str(model_dir), modality)
            model.settings[modality] = settings
            model.register_buffer(f"{modality}_mean", torch.tensor(settings.mean), persistent=False)
            model.register_buffer(f"{modality}_std", torch.tensor(settings.std), persistent=False)
        return model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_multimodal_weights(weights, self.weight_names, dict(self.visual.named_parameters()), self.language_model,
                                encoder_prefix="visual.")

    # ---- the runner's contract -----------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def drop_encoders(self, modalities: set[str]) -> list[str]:
        """Images and videos share the vision tower: it goes only when both are off."""
        if not {"image", "video"} <= modalities:
            return []
        self.visual = None
        return ["visual"]

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One vision-tower pass over all items (attention stays within each frame pair)."""
        if self.visual is None:
            raise ValueError("this model's vision tower is off (--limit-mm-per-prompt image=0,video=0)")
        if modality not in self.settings:
            raise ValueError(f"this model does not encode {modality}")
        settings = self.settings[modality]
        mean, std = getattr(self, f"{modality}_mean"), getattr(self, f"{modality}_std")
        # uint8 frames travel to the device as uint8 and are normalised there.
        device = mean.device
        patches = [patchify(torch.from_numpy(np.asarray(inputs["pixels"])).to(device), mean, std, settings)
                   for inputs in encoder_inputs]
        grids = torch.tensor([list(inputs["grid_thw"]) for inputs in encoder_inputs], dtype=torch.long, device=device)
        dtype = next(self.visual.parameters()).dtype
        merged = self.visual(torch.cat(patches).to(dtype), grid_thw=grids).pooler_output
        sizes = (grids.prod(-1) // settings.merge_size**2).tolist()
        return list(merged.split(sizes))

    def slice_positions(self, state: MRopeState | None, start: int, end: int,
                        num_prompt_tokens: int) -> torch.Tensor | None:
        """[3, end - start] M-RoPE positions from the request's table; None (plain
        positions, which are M-RoPE's (p, p, p)) for a request without media."""
        return None if state is None else state.positions(start, end, num_prompt_tokens)

    def forward(self, inputs_embeds, positions, meta, kv_caches, outputs=None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches, outputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
