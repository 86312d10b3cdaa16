"""The Whisper model for the runner: transformers' encoder, our decoder, the timestamp rules.

The encoder (two convolutions, sinusoidal positions, pre-LN transformer) needs no KV cache,
so transformers' own ``WhisperEncoder`` is built from the checkpoint config; it turns one
30 s window of log-mel features into 1,500 vectors. The decoder is ours
(``decoder.py``): self-attention over the paged cache, cross-attention to K/V held in the
request's blocks of the cross pool (docs/decisions.md D93).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vlmd.layers.linear import SINGLE, TPGroup, adopt_linear_modules
from vlmd.models.base import CrossAttentionKV, ModelCapabilities
from vlmd.models.loader import iterate_weights
from vlmd_whisper.alignment import (
    DEFAULT_MEDIAN_FILTER_WIDTH, alignment_heads, alignment_matrix, cross_attention_weights,
)
from vlmd_whisper.decoder import CrossState, WhisperDecoder
from vlmd_whisper.timestamps import TimestampRules


def generation_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


class WhisperModel(nn.Module):
    """Under tensor parallelism (``tp``) the decoder is sharded; the encoder is replicated:
    every rank encodes every window (docs/architecture.md, "Tensor parallelism")."""

    # The decoder cross-attends to its request's one audio window; the timestamp rules and
    # word timings are Whisper's own.
    capabilities = ModelCapabilities(cross_attention_kv=CrossAttentionKV.FROM_ITEM, process_logits=True,
                                     align_tokens=True)

    def __init__(self, config, generation: dict, tp: TPGroup = SINGLE):
        super().__init__()
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        config._attn_implementation = "sdpa"
        self.config = config
        self.encoder = WhisperEncoder(config)
        # Its attention and MLP products (M = 1,500 frames per window) onto the linear seam;
        # the encoder only calls them, never reads their weights (see adopt.py).
        adopt_linear_modules(self.encoder)
        self.decoder = WhisperDecoder(config, tp)
        self.kv_spec = self.decoder.kv_spec
        self.timestamp_rules = TimestampRules.from_generation_config(generation)
        self.num_frames = config.max_source_positions * 2  # conv2 has stride 2
        self.alignment_heads = alignment_heads(generation, config.decoder_layers, config.decoder_attention_heads)
        self.median_filter_width = int(getattr(config, "median_filter_width", DEFAULT_MEDIAN_FILTER_WIDTH))

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype, tp: TPGroup = SINGLE) -> "WhisperModel":
        model = cls(config, generation_config(model_dir), tp)
        model.load_weights(iterate_weights(model_dir))
        return model.to(dtype).eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        encoder_params = dict(self.encoder.named_parameters())
        decoder_weights = []
        loaded_encoder: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model.encoder."):
                target = name.removeprefix("model.encoder.")
                param = encoder_params.get(target)
                if param is None or param.shape != tensor.shape:
                    raise ValueError(f"unexpected weight {name!r} {tuple(tensor.shape)} in Whisper checkpoint")
                with torch.no_grad():
                    param.copy_(tensor.to(param.dtype))
                loaded_encoder.add(target)
            elif name.startswith("model.decoder.") or name == "proj_out.weight":
                decoder_weights.append((name, tensor))
            else:
                raise ValueError(f"unexpected weight {name!r} in Whisper checkpoint")
        loaded_decoder = self.decoder.load_weights(decoder_weights)
        missing = sorted(set(encoder_params) - loaded_encoder) + sorted(self.decoder.expected_weights() - loaded_decoder)
        if missing:
            raise ValueError(f"the Whisper checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    # ---- the runner's contract -----------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        if modality != "audio":
            raise ValueError(f"Whisper does not encode {modality}")
        features = torch.from_numpy(np.stack([inputs["input_features"] for inputs in encoder_inputs]))
        if features.shape[1:] != (self.config.num_mel_bins, self.num_frames):
            raise ValueError(f"expected log-mel features of shape {(self.config.num_mel_bins, self.num_frames)}, "
                             f"got {tuple(features.shape[1:])}")
        dtype = self.encoder.conv1.weight.dtype
        hidden = self.encoder(input_features=features.to(self.encoder.conv1.weight.device, dtype)).last_hidden_state
        return list(hidden.unbind(0))

    def prepare_cross_attention(self, encoder_output: torch.Tensor) -> CrossState:
        return self.decoder.cross_attention_state(encoder_output)

    def forward(self, inputs_embeds, positions, meta, kv_caches, cross_states, outputs=None) -> torch.Tensor:
        return self.decoder(inputs_embeds, positions, meta, kv_caches, cross_states, outputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder.compute_logits(hidden)

    def align_tokens(self, encoder_output: torch.Tensor, token_ids: list[int], first_row: int,
                     num_frames: int) -> np.ndarray:
        """``[len(token_ids) - first_row, frames]``: how the decoded tokens (fed after a prompt
        of ``first_row`` tokens) attend to the first ``num_frames`` encoder frames
        (``alignment.py``); the runner calls it on the engine thread, for word timestamps."""
        if not self.alignment_heads:
            raise RuntimeError("this Whisper checkpoint names no alignment_heads: it cannot time words")
        if self.decoder.layers[0].encoder_attn.num_heads != self.config.decoder_attention_heads:
            raise RuntimeError("word timestamps need every decoder head on one rank (not under tensor parallelism)")
        weights = cross_attention_weights(self.decoder, encoder_output, token_ids, self.alignment_heads)
        return alignment_matrix(weights, first_row, num_frames, self.median_filter_width)

    def process_logits(self, logits: torch.Tensor, states) -> torch.Tensor:
        if self.timestamp_rules is None:
            return logits
        return self.timestamp_rules.apply(logits, states)
