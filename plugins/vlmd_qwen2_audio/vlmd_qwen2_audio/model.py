"""The Qwen2-Audio model: transformers' audio encoder, a linear projector and our Qwen2.

The audio encoder needs no KV cache, so it is transformers' own ``Qwen2AudioEncoder`` built
from the checkpoint config (two convolutions over 3,000 log-mel frames, 1,500 positions,
pre-norm layers, 2x average pooling, a final layer norm); the language model, where the paged
cache lives, is ours. Every clip's features are padded to 30 s and both convolutions run over
all of them, as in transformers; transformers then masks the encoder's *keys* past the clip's
own frames (queries are not masked) and keeps the first ``num_audio_tokens`` pooled vectors,
so the layers here run over the clip's own positions only (``_encode_clip`` says why that is
the same result).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vlmd.layers.linear import SINGLE, TPGroup, adopt_linear_modules
from vlmd.models.base import ModelCapabilities
from vlmd.models.loader import WeightNames, iterate_weights, load_multimodal_weights
from vlmd.models.qwen2 import Qwen2ForCausalLM
from vlmd_qwen2_audio.processing import conv_output_frames, num_audio_tokens

# Checkpoint prefixes (published Qwen2-Audio and transformers 4.x/5.x layouts) -> ours.
WEIGHT_NAMES = WeightNames("Qwen2-Audio", (
    ("model.language_model.", "language_model.model."),
    ("language_model.model.", "language_model.model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
    ("model.audio_tower.", "audio_tower."),
    ("audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
))


class Qwen2AudioProjector(nn.Module):
    def __init__(self, audio_hidden: int, text_hidden: int):
        super().__init__()
        self.linear = nn.Linear(audio_hidden, text_hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioModel(nn.Module):
    capabilities = ModelCapabilities()

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

        self.config = config
        audio_config = config.audio_config
        audio_config._attn_implementation = "sdpa"
        self.audio_tower = Qwen2AudioEncoder(audio_config)
        adopt_linear_modules(self.audio_tower)  # its linears on the seam (adopt.py), as Whisper's encoder
        self.multi_modal_projector = Qwen2AudioProjector(audio_config.d_model, config.text_config.hidden_size)
        self.language_model = Qwen2ForCausalLM(config.text_config, tp=tp)  # sharded; the encoder replicated
        self.kv_spec = self.language_model.kv_spec

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype, tp: TPGroup = SINGLE) -> "Qwen2AudioModel":
        model = cls(config, tp)
        model.load_weights(iterate_weights(model_dir))
        return model.to(dtype).eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = {name: p for name, p in self.named_parameters() if not name.startswith("language_model.")}
        load_multimodal_weights(weights, WEIGHT_NAMES, params, self.language_model)

    # ---- the runner's contract -----------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """The step's clips through the encoder: ``[num_audio_tokens, hidden]`` per clip."""
        if modality != "audio":
            raise ValueError(f"Qwen2-Audio does not encode {modality}")
        tower = self.audio_tower
        dtype = self.multi_modal_projector.linear.weight.dtype
        features = torch.from_numpy(np.stack([np.asarray(i["input_features"]) for i in encoder_inputs])).to(dtype)
        # The convolutions see the whole 30 s, padding included, as in transformers.
        hidden = F.gelu(tower.conv2(F.gelu(tower.conv1(features)))).permute(0, 2, 1)
        outputs = []
        for index, inputs in enumerate(encoder_inputs):
            num_frames = int(inputs["num_frames"])
            outputs.append(self._encode_clip(hidden[index : index + 1], num_frames))
        return outputs

    def _encode_clip(self, hidden: torch.Tensor, num_frames: int) -> torch.Tensor:
        """The encoder layers over the clip's own positions only.

        transformers runs all 1,500 positions and masks the keys past the clip, so a padded
        position never reaches a clip position (queries are not masked, but those rows are
        dropped at the end): leaving them out is the same arithmetic, minus masked terms that
        are exactly zero, for (1,500 / clip positions) times less attention work.
        """
        tower = self.audio_tower
        length = conv_output_frames(num_frames)
        hidden = hidden[:, :length] + tower.embed_positions.weight[:length]
        for layer in tower.layers:
            hidden = layer(hidden, None)
        pooled = tower.avg_pooler(hidden.permute(0, 2, 1)).permute(0, 2, 1)
        return self.multi_modal_projector(tower.layer_norm(pooled))[0, : num_audio_tokens(num_frames)]

    def forward(self, inputs_embeds, positions, meta, kv_caches, outputs=None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches, outputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
