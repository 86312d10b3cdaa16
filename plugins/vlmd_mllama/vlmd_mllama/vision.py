"""The Llama 3.2 Vision tower and projector: transformers' own ``MllamaVisionModel`` (it needs
no KV cache) built from the checkpoint config, its linear layers moved onto the linear seam.

Per tile: a patch convolution, a class token, gated position and tile-position embeddings
(picked by the image's aspect-ratio id), a local transformer over each tile, then a gated
global transformer across the image's tiles (padding tiles masked out); the output is the
last hidden state concatenated with the local transformer's ``intermediate_layers_indices``
states. The projector maps it to the text model's width: ``max_tiles x tokens_per_tile``
vectors per image, the padding tiles' too (a token before the first image attends to them).

Pixels arrive as uint8 tiles; rescale and normalisation happen here in float32, as
transformers' processor does them in numpy; absent tiles are zeros after normalisation
(its ``pack_images``), the black padding inside the canvas is normalised black.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from vlmd.layers.linear import ReplicatedLinear, adopt_linear_modules
from vlmd_mllama.tiles import TileSettings


class MllamaVisionTower(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers.models.mllama.modeling_mllama import MllamaVisionModel

        vision = config.vision_config
        vision._attn_implementation = "sdpa"
        self.vision_model = MllamaVisionModel(vision)
        adopt_linear_modules(self.vision_model)
        self.multi_modal_projector = ReplicatedLinear(int(vision.vision_output_dim),
                                                      int(config.text_config.hidden_size), bias=True)
        self.max_tiles = int(vision.max_num_tiles)
        self.tile_size = int(vision.image_size)
        self.tokens_per_tile = (self.tile_size // int(vision.patch_size)) ** 2 + 1

    def set_pixel_norm(self, settings: TileSettings) -> None:
        """Registered after the dtype cast: normalisation stays float32, as the reference's."""
        self.register_buffer("pixel_mean", torch.tensor(settings.mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(settings.std).view(1, 3, 1, 1), persistent=False)
        self.rescale_factor = settings.rescale_factor

    def forward(self, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One ``[max_tiles * tokens_per_tile, text hidden]`` tensor per image."""
        weight = self.vision_model.patch_embedding.weight
        device, dtype = weight.device, weight.dtype
        count = len(encoder_inputs)
        size = self.tile_size
        pixels = torch.zeros(count, 1, self.max_tiles, 3, size, size, dtype=torch.float32, device=device)
        ratio_ids = torch.zeros(count, 1, dtype=torch.long, device=device)
        tile_mask = torch.zeros(count, 1, self.max_tiles, dtype=torch.long, device=device)
        for index, inputs in enumerate(encoder_inputs):
            tiles = np.asarray(inputs["tiles"])
            if tiles.dtype != np.uint8 or tiles.ndim != 4 or tiles.shape[1:] != (3, size, size) \
                    or not 1 <= tiles.shape[0] <= self.max_tiles:
                raise ValueError(f"expected uint8 tiles [1..{self.max_tiles}, 3, {size}, {size}], got "
                                 f"{tiles.dtype} {tiles.shape}")
            tiles = torch.from_numpy(tiles).to(device)
            pixels[index, 0, : tiles.shape[0]] = (tiles.to(torch.float32) * self.rescale_factor - self.pixel_mean) \
                / self.pixel_std
            ratio_ids[index, 0] = int(inputs["aspect_ratio_id"])
            tile_mask[index, 0, : tiles.shape[0]] = 1
        hidden = self.vision_model(pixel_values=pixels.to(dtype), aspect_ratio_ids=ratio_ids,
                                   aspect_ratio_mask=tile_mask).last_hidden_state  # [count, 1, tiles, tokens, dim]
        projected = self.multi_modal_projector(hidden.reshape(-1, hidden.shape[-1]))
        return list(projected.view(count, self.max_tiles * self.tokens_per_tile, -1).unbind(0))
