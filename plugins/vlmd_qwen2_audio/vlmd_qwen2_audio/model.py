"""The Qwen2-Audio model: transformers' audio encoder, a linear projector and our Qwen2.

The audio encoder needs no KV cache, so it is transformers' own ``Qwen2AudioEncoder`` built
from the checkpoint config (two convolutions over 3,000 log-mel frames, 1,500 positions,
pre-norm layers, 2x average pooling, a final layer norm); the language model, where the paged
cache lives, is ours. Every clip's features are padded to 30 s; as in transformers, the
encoder's attention masks the *keys* past the clip's own frames (queries are not masked), and
only the first ``num_audio_tokens`` pooled vectors of a clip are kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vlmd.models.loader import iterate_weights
from vlmd.models.qwen2 import Qwen2ForCausalLM
from vlmd_qwen2_audio.processing import conv_output_frames, num_audio_tokens

# Checkpoint prefixes (published Qwen2-Audio and transformers 4.x/5.x layouts) -> ours.
_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("language_model.model.", "language_model.model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
    ("model.audio_tower.", "audio_tower."),
    ("audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def _rename(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    raise ValueError(f"unexpected weight {name!r} in Qwen2-Audio checkpoint")


class Qwen2AudioProjector(nn.Module):
    def __init__(self, audio_hidden: int, text_hidden: int):
        super().__init__()
        self.linear = nn.Linear(audio_hidden, text_hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

        self.config = config
        audio_config = config.audio_config
        audio_config._attn_implementation = "sdpa"
        self.audio_tower = Qwen2AudioEncoder(audio_config)
        self.multi_modal_projector = Qwen2AudioProjector(audio_config.d_model, config.text_config.hidden_size)
        self.language_model = Qwen2ForCausalLM(config.text_config)
        self.kv_spec = self.language_model.kv_spec

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype) -> "Qwen2AudioModel":
        model = cls(config)
        model.load_weights(iterate_weights(model_dir))
        return model.to(dtype).eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = {name: p for name, p in self.named_parameters() if not name.startswith("language_model.")}
        text_weights = []
        filled: set[str] = set()
        for name, tensor in weights:
            target = _rename(name)
            if target.startswith("language_model."):
                text_weights.append((target[len("language_model.") :], tensor))
                continue
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in Qwen2-Audio checkpoint")
            if params[target].shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[target].shape)}"
                )
            with torch.no_grad():
                params[target].copy_(tensor)
            filled.add(target)
        loaded = self.language_model.load_weights(text_weights)
        missing = sorted(set(params) - filled) + sorted(
            {name for name, _ in self.language_model.named_parameters()} - loaded
        )
        if missing:
            raise ValueError(f"Qwen2-Audio checkpoint lacks weights, e.g. {missing[:3]}")

    # ---- the runner's contract -----------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One encoder pass over the step's clips: ``[num_audio_tokens, hidden]`` per clip."""
        if modality != "audio":
            raise ValueError(f"Qwen2-Audio does not encode {modality}")
        from transformers.masking_utils import create_bidirectional_mask

        dtype = self.multi_modal_projector.linear.weight.dtype
        features = torch.from_numpy(np.stack([np.asarray(i["input_features"]) for i in encoder_inputs])).to(dtype)
        frames = [int(i["num_frames"]) for i in encoder_inputs]
        positions = self.audio_tower.config.max_source_positions
        lengths = torch.tensor([conv_output_frames(n) for n in frames])
        keys_2d = (torch.arange(positions)[None, :] < lengths[:, None]).to(torch.long)
        # As transformers builds it: a mask over keys only, broadcast over every query.
        mask = create_bidirectional_mask(
            config=self.audio_tower.config,
            inputs_embeds=torch.zeros(len(frames), positions, 1, dtype=dtype),
            attention_mask=keys_2d,
        )
        hidden = self.audio_tower(features, attention_mask=mask).last_hidden_state
        projected = self.multi_modal_projector(hidden)
        return [projected[index, : num_audio_tokens(n)] for index, n in enumerate(frames)]

    def forward(self, inputs_embeds, positions, meta, kv_caches) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
