"""The InternVL3 model: transformers' InternViT tower, pixel shuffle, our projector and Qwen2.

Every tile (448 px in the published checkpoints) goes through the tower on its own; its patch
vectors (the CLS vector dropped) are pixel-shuffled 0.5, each 2x2 block of neighbours
concatenated into one vector of 4x the width, so a tile's 32x32 patches become 16x16 = 256
vectors, which a LayerNorm + two-layer MLP projects into the language model's width. A video's
frames are tiles too. The tower
needs no KV cache, so it is transformers' own module built from the checkpoint config, its
linears on our seam (``adopt_linear_modules``); the Qwen2 decoder, where the paged cache lives,
is ours, so tensor parallelism and the CPU fast paths come with it. Under tensor parallelism
the decoder is sharded; the tower and projector are replicated: every rank encodes every image.
"""

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
from vlmd.models.loader import WeightNames, iterate_weights, load_multimodal_weights
from vlmd.models.qwen2 import Qwen2ForCausalLM
from vlmd_internvl.settings import read_pixel_norm
from vlmd_internvl.video import interleave_frames

# Checkpoint prefixes (transformers 5 and the 4.x layout of the published -hf checkpoints) -> ours.
WEIGHT_NAMES = WeightNames("InternVL", (
    ("model.language_model.", "language_model.model."),
    ("language_model.model.", "language_model.model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
))


def pixel_shuffle(features: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, side, side, C]`` -> ``[B, side * scale, side * scale, C / scale**2]``, in
    transformers' order of the concatenated neighbours (so the projector's columns match)."""
    batch, width, height, channels = features.shape
    if (height * scale) % 1 or (width * scale) % 1:
        raise ValueError(f"a {width}x{height} patch grid does not pixel-shuffle by {scale}")
    features = features.reshape(batch, width, int(height * scale), int(channels / scale))
    features = features.permute(0, 2, 1, 3)
    features = features.reshape(batch, int(height * scale), int(width * scale), int(channels / scale**2))
    return features.permute(0, 2, 1, 3)


class InternVLProjector(nn.Module):
    def __init__(self, in_width: int, text_hidden: int, act: str):
        super().__init__()
        from transformers.activations import ACT2FN

        self.layer_norm = nn.LayerNorm(in_width)
        # Our linear seam: it runs over every tile's 256 rows, a product worth a kernel choice.
        self.linear_1 = ReplicatedLinear(in_width, text_hidden)
        self.act = ACT2FN[act]
        self.linear_2 = ReplicatedLinear(text_hidden, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVLModel(nn.Module):
    capabilities = ModelCapabilities(drop_encoders=True)

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        from transformers.models.internvl.modeling_internvl import InternVLVisionModel

        self.config = config
        vision_config = config.vision_config
        vision_config._attn_implementation = TOWER_ATTENTION  # SDPA; bfloat16 by AVX512-BF16 (D118)
        if getattr(config, "vision_feature_select_strategy", "default") != "default":
            raise ValueError("InternVL with vision_feature_select_strategy other than 'default' is not supported")
        feature_layer = config.vision_feature_layer
        if not isinstance(feature_layer, int):
            raise ValueError(f"vision_feature_layer {feature_layer!r} is not supported (an int is)")
        num_layers = vision_config.num_hidden_layers
        # -1 is the tower's output (after its final norm); k is hidden_states[k] (0: embeddings).
        self.final_norm = feature_layer == -1
        self.num_vision_layers = num_layers if self.final_norm else feature_layer % (num_layers + 1)
        self.vision_tower = InternVLVisionModel(vision_config)
        self.vision_tower.encoder.layer = self.vision_tower.encoder.layer[: self.num_vision_layers]
        adopt_linear_modules(self.vision_tower)
        self.downsample_ratio = float(config.downsample_ratio)
        shuffled_width = vision_config.hidden_size * int(1 / self.downsample_ratio) ** 2
        self.multi_modal_projector = InternVLProjector(shuffled_width, config.text_config.hidden_size,
                                                       config.projector_hidden_act)
        text_type = getattr(config.text_config, "model_type", "qwen2")
        if text_type != "qwen2":  # InternVL3-9B's InternLM3, and Llama-based InternVLs, are not built here
            raise ValueError(f"InternVL with a {text_type} language model is not supported (Qwen2/Qwen2.5 is)")
        # transformers ties lm_head to the embeddings by the outer config's flag (default True).
        tie = getattr(config, "tie_word_embeddings", None)
        if tie is None:
            tie = getattr(config.text_config, "tie_word_embeddings", False)
        self.language_model = Qwen2ForCausalLM(config.text_config, tie_word_embeddings=bool(tie), tp=tp)
        self.kv_spec = self.language_model.kv_spec

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype, tp: TPGroup = SINGLE) -> "InternVLModel":
        model = cls(config, tp)
        model.load_weights(iterate_weights(model_dir))
        model = model.to(dtype).eval()
        # Registered after the dtype cast: normalisation stays float32, as the reference's.
        for modality in ("image", "video"):
            norm = read_pixel_norm(str(model_dir), modality)
            model.register_buffer(f"{modality}_mean", torch.tensor(norm.mean).view(1, 3, 1, 1), persistent=False)
            model.register_buffer(f"{modality}_std", torch.tensor(norm.std).view(1, 3, 1, 1), persistent=False)
        return model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = {name: p for name, p in self.named_parameters() if not name.startswith("language_model.")}
        load_multimodal_weights(weights, WEIGHT_NAMES, params, self.language_model, not_built=self._never_built)

    def _never_built(self, target: str) -> bool:
        """Tower layers past the feature layer (and then its final norm) are never run."""
        if target.startswith("vision_tower.encoder.layer."):
            return int(target.split(".")[3]) >= self.num_vision_layers
        return not self.final_norm and target.startswith("vision_tower.layernorm.")

    def drop_encoders(self, modalities: set[str]) -> list[str]:
        """Images and videos share the tower: it and the projector go only when both are off."""
        if not {"image", "video"} <= modalities:
            return []
        self.vision_tower = None
        self.multi_modal_projector = None
        return ["vision_tower", "multi_modal_projector"]

    # ---- the runner's contract -----------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Every tile (a video's frames are tiles) of every item through the tower in one
        batch. An image's output is ``[tiles * 256, hidden]``, tiles in the processor's order
        (the thumbnail last); a video's also holds the embeddings of the frame labels between
        its frames, as its placeholder span does (``video.py``)."""
        if self.vision_tower is None:
            raise ValueError(f"this InternVL does not encode {modality} (its encoder is off: --limit-mm-per-prompt)")
        if modality not in ("image", "video"):
            raise ValueError(f"InternVL does not encode {modality}")
        counts = [len(inputs["tiles"]) for inputs in encoder_inputs]
        tiles = np.concatenate([inputs["tiles"] for inputs in encoder_inputs])
        per_tile = self.encode_tiles(tiles, getattr(self, f"{modality}_mean"), getattr(self, f"{modality}_std"))
        outputs = []
        for inputs, features in zip(encoder_inputs, per_tile.split(counts)):
            if modality == "image":
                outputs.append(features.reshape(-1, features.shape[-1]))
                continue
            between = [self.embed_input_ids(torch.as_tensor(ids, device=features.device)) for ids in inputs["between"]]
            outputs.append(interleave_frames(list(features.unbind(0)), between))
        return outputs

    def encode_tiles(self, tiles: np.ndarray, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """uint8 tiles ``[N, 3, S, S]`` -> ``[N, tokens_per_tile, text hidden]``."""
        # uint8 travels to the device as uint8 (a quarter of float32's bytes).
        pixels = torch.from_numpy(tiles).to(mean.device)
        pixel_values = (pixels.to(torch.float32) / 255.0 - mean) / std
        tower = self.vision_tower
        dtype = tower.embeddings.patch_embeddings.projection.weight.dtype
        hidden = tower.embeddings(pixel_values.to(dtype))
        for layer in tower.encoder.layer:
            hidden = layer(hidden)
        if self.final_norm:
            hidden = tower.layernorm(hidden)
        patches = hidden[:, 1:]  # the CLS vector is not an image token
        side = int(patches.shape[1] ** 0.5)
        shuffled = pixel_shuffle(patches.reshape(len(patches), side, side, -1), self.downsample_ratio)
        return self.multi_modal_projector(shuffled.reshape(len(patches), -1, shuffled.shape[-1]))

    def forward(self, inputs_embeds, positions, meta, kv_caches, outputs=None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches, outputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
