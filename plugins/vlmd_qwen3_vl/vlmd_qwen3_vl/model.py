"""The Qwen3-VL model (dense): transformers' vision tower and our Qwen3 with DeepStack.

The vision tower needs no KV cache, so it is transformers' own module built from the
checkpoint config (16-px patches of frame pairs, learned positions interpolated to each
grid, 2D RoPE, a 2x2 merger), fed by Qwen2-VL's ``patchify`` (the same patch layout, at
16 px); the language model, where the paged cache lives, is our
``Qwen3ForCausalLM`` with interleaved M-RoPE (positions from the processor, see
``positions.py``).

DeepStack: the tower also merges the hidden states of a few of its layers
(``deepstack_visual_indexes``), one vector per placeholder each, which the reference adds to
the decoder's hidden states at the placeholders after its first layers. So one encoder
output row here is ``[main | deepstack 0 | deepstack 1 | ...]``, each as wide as the
decoder: the runner stores, caches and slices rows as for any family, and hands this model
the rows of each step (``merge_multimodal``), which writes the main part into the
embeddings and passes the rest to the decoder (``Qwen3ForCausalLM.forward(additions=)``).
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
from vlmd.layers.rotary import MRotaryEmbedding, mrope_section, rope_parameters
from vlmd.models.base import ModelCapabilities
from vlmd.models.loader import WeightNames, iterate_weights, load_multimodal_weights
from vlmd.models.qwen3 import Qwen3ForCausalLM
from vlmd.models.qwen3_moe import Qwen3MoeForCausalLM
from vlmd_qwen2_vl.model import patchify
from vlmd_qwen3_vl.positions import PositionTable
from vlmd_qwen3_vl.settings import MODALITIES, VisionSettings, read_settings
from vlmd_qwen3_vl.video import interleave_rows

# Checkpoint prefixes (transformers 5 layout, and the published one) -> ours.
WEIGHT_NAMES = WeightNames("Qwen3-VL", (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
))
DEFAULT_MROPE_SECTION = [24, 20, 20]  # transformers' default where a config names none


def _vision_model_class(config) -> type:
    """transformers' tower for this config: the MoE checkpoints' is the same module under
    its own config class."""
    if type(config).__name__ == "Qwen3VLMoeConfig":
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

        return Qwen3VLMoeVisionModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return Qwen3VLVisionModel


def interleaved_mrope(text_config) -> MRotaryEmbedding:
    """transformers' Qwen3-VL text rotary interleaves the rows whatever the config says."""
    theta, scaling = rope_parameters(text_config)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    section = mrope_section(text_config) or DEFAULT_MROPE_SECTION
    return MRotaryEmbedding(head_dim, text_config.max_position_embeddings, theta, scaling, section, interleaved=True)


class VisionItems:
    """The vision half of a Qwen3-VL-style model, shared with the families built on its tower
    (Qwen3.5): loading, the pixel settings, dropping the tower, encoding a batch of items into rows,
    and the positions of the M-RoPE table. The model sets ``visual``, ``language_model``,
    ``settings`` and ``encoder_output_width``, names its checkpoint's ``weight_names`` and
    defines ``tower_rows(out)`` (its row per placeholder from the tower's output)."""

    family_name = "Qwen3-VL"

    @classmethod
    def load(cls, model_dir: str | Path, config, dtype: torch.dtype, tp: TPGroup = SINGLE):
        model = cls(config, tp)
        model.load_weights(iterate_weights(model_dir))
        model = model.to(dtype).eval()
        model.read_vision_settings(model_dir)
        return model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's tower into ``visual``, its text model through the decoder's
        loader (``weight_names``: the family's table)."""
        load_multimodal_weights(weights, self.weight_names, dict(self.visual.named_parameters()), self.language_model,
                                encoder_prefix="visual.")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def read_vision_settings(self, model_dir: str | Path) -> None:
        """The checkpoint's image and video settings, their normalisation as buffers
        (registered after the dtype cast: it stays float32, as the reference's)."""
        for modality in MODALITIES:
            settings = read_settings(str(model_dir), modality)
            self.settings[modality] = settings
            self.register_buffer(f"{modality}_mean", torch.tensor(settings.mean), persistent=False)
            self.register_buffer(f"{modality}_std", torch.tensor(settings.std), persistent=False)

    def slice_positions(self, state: PositionTable | None, start: int, end: int,
                        num_prompt_tokens: int) -> torch.Tensor | None:
        """[3, end - start] M-RoPE positions from the request's table; None (plain
        positions, which are M-RoPE's (p, p, p)) for a request without media."""
        return None if state is None else state.positions(start, end, num_prompt_tokens)

    def drop_encoders(self, modalities: set[str]) -> list[str]:
        if not set(MODALITIES) <= modalities:
            return []
        self.visual = None
        return ["visual"]

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One vision-tower pass over all items; per item ``[tokens, encoder_output_width]``.
        A video's rows run over its whole span: each frame pair's rows, and between pairs the
        rows of the timestamp text there (``video.py``)."""
        if self.visual is None:
            raise ValueError(f"this {self.family_name}'s vision tower is off (--limit-mm-per-prompt image=0,video=0)")
        if modality not in self.settings:
            raise ValueError(f"{self.family_name} does not encode {modality}")
        settings = self.settings[modality]
        mean, std = getattr(self, f"{modality}_mean"), getattr(self, f"{modality}_std")
        device = mean.device
        patches = [patchify(torch.from_numpy(np.asarray(inputs["pixels"])).to(device), mean, std, settings)
                   for inputs in encoder_inputs]
        grids = torch.tensor([list(inputs["grid_thw"]) for inputs in encoder_inputs], dtype=torch.long, device=device)
        dtype = next(self.visual.parameters()).dtype
        out = self.visual(torch.cat(patches).to(dtype), grid_thw=grids)
        rows = self.tower_rows(out)
        sizes = (grids.prod(-1) // settings.merge_size**2).tolist()
        outputs = list(rows.split(sizes))
        if modality == "video":
            for index, (inputs, grid) in enumerate(zip(encoder_inputs, grids.tolist())):
                pairs = list(outputs[index].split(grid[1] * grid[2] // settings.merge_size**2))
                between = [self.embed_input_ids(torch.as_tensor(ids, device=device)) for ids in inputs["between"]]
                outputs[index] = interleave_rows(pairs, between, self.encoder_output_width)
        return outputs


class Qwen3VLModel(VisionItems, nn.Module):
    """Under tensor parallelism (``tp``) the Qwen3 decoder is sharded; the vision tower is
    replicated: every rank encodes every image (docs/architecture.md)."""

    weight_names = WEIGHT_NAMES
    capabilities = ModelCapabilities(slice_positions=True, merge_multimodal=True, drop_encoders=True)

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        vision_config, text_config = config.vision_config, config.text_config
        vision_config._attn_implementation = TOWER_ATTENTION  # SDPA; bfloat16 by AVX512-BF16 (D118)
        self.visual = _vision_model_class(config)(vision_config)
        adopt_linear_modules(self.visual)  # on the seam, as Qwen2-VL's (108 ms a 640x480 image against 129)
        self.num_deepstack = len(vision_config.deepstack_visual_indexes)
        if self.num_deepstack >= text_config.num_hidden_layers:
            raise ValueError(f"{self.num_deepstack} DeepStack layers for a decoder of {text_config.num_hidden_layers}")
        self.hidden_size = int(text_config.hidden_size)
        if int(vision_config.out_hidden_size) != self.hidden_size:
            raise ValueError(f"vision out_hidden_size {vision_config.out_hidden_size} is not the decoder's "
                             f"hidden size {self.hidden_size}")
        self.encoder_output_width = self.hidden_size * (1 + self.num_deepstack)
        # Experts in the text model (Qwen3-VL-MoE): the same decoder with a sparse MLP.
        decoder = Qwen3MoeForCausalLM if getattr(text_config, "num_experts", 0) else Qwen3ForCausalLM
        self.language_model = decoder(
            text_config, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rotary=interleaved_mrope(text_config), tp=tp,
        )
        self.kv_spec = self.language_model.kv_spec
        self.settings: dict[str, VisionSettings] = {}

    # ---- the runner's contract -----------------------------------------------------

    def tower_rows(self, out) -> torch.Tensor:
        """Each placeholder's row: the merged vector and its DeepStack ones."""
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    def merge_multimodal(self, inputs_embeds: torch.Tensor, rows: torch.Tensor,
                         features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The main vectors into the placeholder rows; the DeepStack ones ``[k, n, hidden]``
        for ``forward`` to add after the first k layers."""
        if features.shape[-1] != self.encoder_output_width:
            raise RuntimeError(f"encoder rows of width {features.shape[-1]}; Qwen3-VL's are {self.encoder_output_width}")
        inputs_embeds[rows] = features[:, : self.hidden_size].to(inputs_embeds.dtype)
        deepstack = features[:, self.hidden_size :].reshape(len(rows), self.num_deepstack, self.hidden_size)
        return rows, deepstack.transpose(0, 1)

    def forward(self, inputs_embeds, positions, meta, kv_caches, outputs=None, multimodal=None) -> torch.Tensor:
        return self.language_model(inputs_embeds, positions, meta, kv_caches, outputs, additions=multimodal)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
