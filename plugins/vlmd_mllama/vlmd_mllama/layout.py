"""Which images each token of a request cross-attends to: transformers' cross-attention mask,
as one small object per request (the family state the core carries to the model).

transformers' ``MllamaProcessor`` gives image ``i`` (its ``<|image|>`` token at ``loc_i``) the
tokens from ``loc_i`` up to the next image's token; the last image keeps every later token,
and images whose tokens are adjacent all keep the span of the last of them. Within a span a
token attends to the image's real tiles only (not the tiles that pad it to the tower's
maximum). Generated tokens attend as the prompt's last token does (generate repeats the mask's
last row). A token no image covers (text before the first image) has its whole mask row
off, and transformers then lets it attend to *every* vision token, padding tiles included,
unmasked, while zeroing that cross-attention layer's MLP output for it
(``full_text_row_masked_out_mask``); a request without images skips the cross-attention
layers altogether. The model reproduces both (``decoder.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CrossLayout:
    """``spans[i]``: the tokens ``[start, end)`` that attend to image ``i`` (``end`` None: to the
    end of the sequence, generated tokens included); ``tiles[i]``: its real tiles."""

    spans: tuple[tuple[int, int | None], ...]
    tiles: tuple[int, ...]


def image_spans(token_ids: list[int], image_token_id: int) -> tuple[tuple[int, int | None], ...]:
    """transformers' ``get_cross_attention_token_mask``, with a span reaching the prompt's end
    left open (its last row is the one generation repeats)."""
    locations = [index for index, token in enumerate(token_ids) if token == image_token_id]
    if not locations:
        return ()
    spans = [[start, end] for start, end in zip(locations, locations[1:])]
    spans.append([locations[-1], len(token_ids)])
    last_end = spans[-1][1]
    for span in reversed(spans):  # adjacent image tokens share the span of the last of them
        if span[0] == span[1] - 1:
            span[1] = last_end
        last_end = span[1]
    return tuple((start, None if end >= len(token_ids) else end) for start, end in spans)


def build_layout(token_ids: list[int], image_token_id: int, tiles: list[int]) -> CrossLayout | None:
    spans = image_spans(token_ids, image_token_id)
    if len(spans) != len(tiles):
        raise ValueError(f"{len(spans)} image tokens for {len(tiles)} images")
    return CrossLayout(spans, tuple(tiles)) if spans else None


def row_masks(layout: CrossLayout, positions: torch.Tensor, max_tiles: int,
              tokens_per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the tokens at ``positions`` ``[n]``: (allowed ``[n, images * max_tiles *
    tokens_per_tile]`` bool, covered ``[n]`` bool). A row no image covers gets every vision
    token allowed (transformers' zeroed mask row), and covered False."""
    per_image = max_tiles * tokens_per_tile
    device = positions.device
    token_tile = torch.arange(per_image, device=device) // tokens_per_tile
    blocks = []
    for (start, end), tiles in zip(layout.spans, layout.tiles):
        inside = positions >= start
        if end is not None:
            inside &= positions < end
        blocks.append(inside[:, None] & (token_tile < tiles)[None, :])
    allowed = torch.cat(blocks, dim=1)
    covered = allowed.any(dim=1)
    return allowed | ~covered[:, None], covered
