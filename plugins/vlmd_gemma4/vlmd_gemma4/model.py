"""The Gemma 4 model: transformers' vision tower and embedder, our text decoder (``decoder.py``).

The tower needs no KV cache, so it is transformers' ``Gemma4VisionModel`` (2-D RoPE and a
learned position table over an image's patches, which attend to each other both ways; k x k
average pooling by patch position; standardization) and ``Gemma4MultimodalEmbedder`` (an
unscaled RMSNorm and a projection into the text width), built from the checkpoint's config.
Each image is encoded alone over its own patches: transformers pads every image to its
budget's patch count and masks the padding out of attention and pooling, which computes the
same vectors. A video's frames go through the same tower and embedder, each as an image, and
the timestamp text between them keeps its own embeddings (``video.py``). A media token's
embedding row is its tower output; its per-layer part is the pad token's, as transformers
looks media ids up as pad (``embed_input_ids``; the decoder's module docstring says why). Where the config
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
from vlmd.processing.frame_text import interleave_rows
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
            # The encoder's linears on the seam (adopt.py), as every tower's; not the patch
            # embedder's projection, whose weight's dtype transformers reads in forward (a
            # kernel that packs a weight drops the plain one: in bfloat16 the timing chose so
            # and the tower failed at start-up).
            adopt_linear_modules(self.vision_tower.encoder)
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
        # Media ids, looked up as the pad token for their per-layer embeddings (transformers'
        # llm_input_ids); their token rows are the encoder's.
        media = [config.image_token_id, config.video_token_id, config.audio_token_id]
        self.register_buffer("media_token_ids", torch.tensor([int(i) for i in media if i is not None]),
                             persistent=False)
        self.pad_token_id = int(text.pad_token_id)

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype, tp: TPGroup = SINGLE) -> "Gemma4Model":
        model = cls(config, tp)
        model.load_weights(iterate_weights(model_dir))
        # The tower's standardization stays float32 whatever the server's dtype (docs/decisions.md
        # D114): its std_bias cancels pooled features of the same size, up to ~1e5 in the large
        # checkpoints, past float16's 65504 (vLLM #40290), and a 16-bit copy would round it to
        # 32s (float16) or 256s (bfloat16) before the cancellation.
        standardization = model.standardization_buffers()
        for name, module in model.named_children():  # the audio tower in its own dtype (audio.py)
            module.to(audio.tower_dtype(dtype) if name in ("audio_tower", "embed_audio") else dtype)
        model = model.eval()
        for name, value in standardization.items():
            model.vision_tower.register_buffer(name, value)
        return model

    def standardization_buffers(self) -> dict[str, torch.Tensor]:
        """The vision tower's ``std_bias`` and ``std_scale`` as float32 (none without a tower or
        where the config does not standardize)."""
        if self.vision_tower is None:
            return {}
        return {name: buffer.detach().to(torch.float32).clone() for name, buffer in self.vision_tower.named_buffers()
                if name in ("std_bias", "std_scale")}

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
        """A media token (image, video, audio) is looked up as the pad token: its per-layer
        part stays so, its token part is the encoder output's (``merge_multimodal``)."""
        media = torch.isin(input_ids, self.media_token_ids.to(input_ids.device))
        return self.language_model.embed_input_ids(torch.where(media, self.pad_token_id, input_ids))

    def drop_encoders(self, modalities: set[str]) -> list[str]:
        dropped = []
        if {"image", "video"} <= modalities and self.vision_tower is not None:
            self.vision_tower = self.embed_vision = None
            dropped += ["vision_tower", "embed_vision"]
        if "audio" in modalities and self.audio_tower is not None:
            self.audio_tower = self.embed_audio = None
            dropped += ["audio_tower", "embed_audio"]
        return dropped

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each image through the tower alone (module docstring): [soft tokens, text hidden]. A
        video's frames (one size) through it together, its rows interleaved with the
        embeddings of the timestamp text between frames: [span, text hidden]. Each audio
        clip through the audio tower alone."""
        if modality == "audio":
            return self.embed_audio_clips(encoder_inputs)
        if modality not in ("image", "video"):
            raise ValueError(f"Gemma 4 does not encode {modality} yet")
        if self.vision_tower is None:
            raise ValueError("this Gemma 4's vision tower is off (--limit-mm-per-prompt image=0,video=0)")
        if modality == "video":
            return [self.encode_video(inputs) for inputs in encoder_inputs]
        return [self.encode_frames(inputs["pixels"][None], int(inputs["patch_size"])) for inputs in encoder_inputs]

    def encode_frames(self, frames: np.ndarray, patch_size: int) -> torch.Tensor:
        """[frames x soft tokens, text hidden] of uint8 ``[frames, H, W, 3]`` of one size."""
        device = self.language_model.embed_tokens.weight.device
        dtype = next(self.vision_tower.parameters()).dtype
        pixels = torch.from_numpy(np.ascontiguousarray(frames)).to(device)
        patches, positions = zip(*(patches_of(frame, patch_size) for frame in pixels))
        encoded = self.vision_tower(pixel_values=torch.stack(patches).to(dtype),
                                    pixel_position_ids=torch.stack(positions).to(device)).last_hidden_state
        return self.embed_vision(encoded)

    def encode_video(self, inputs: dict[str, Any]) -> torch.Tensor:
        rows = self.encode_frames(inputs["frames"], int(inputs["patch_size"]))
        device = rows.device
        hidden = self.language_model.hidden_size
        between = [self.language_model.embed_input_ids(torch.as_tensor(ids, device=device))[:, :hidden]
                   for ids in inputs["between"]]
        return interleave_rows(list(rows.split(int(inputs["tokens_per_frame"]))), between, hidden)

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
        """An item's rows: the encoder's vectors in the token part; the per-layer part is
        what ``embed_input_ids`` gave (the pad token's at media ids, a timestamp's own)."""
        inputs_embeds[rows, :self.language_model.hidden_size] = features.to(inputs_embeds.dtype)
        return None

    def attention_spans(self, items: list[MultiModalItem]) -> list[tuple[int, int]]:
        """Each image's soft tokens, each video frame's (not their boundary tokens nor the
        timestamps: transformers' mm_token_type_ids), where they attend both ways; none
        otherwise. Audio soft tokens stay causal (transformers marks only vision tokens)."""
        if not self.bidirectional_images:
            return []
        spans = []
        for item in items:
            if item.modality == "audio":
                continue
            if item.modality == "video":
                per_frame = int(item.encoder_inputs["tokens_per_frame"])
                spans += [(item.offset + start, item.offset + start + per_frame)
                          for start in item.encoder_inputs["frame_starts"]]
            else:
                spans.append((item.offset, item.end))
        return spans

    def forward(self, inputs_embeds, positions, meta, kv_caches, outputs=None, multimodal=None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches, outputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
