"""InternVL video: one tile per frame, each under its "FrameN:" label.

transformers' ``InternVLProcessor`` replaces the chat template's ``<video>`` with
``"\\n".join(f"Frame{i + 1}: <img>{'<IMG_CONTEXT>' * 256}</img>")``; its video processor resizes
every frame to the tile size (no tiling, no thumbnail). The labels are text inside the item, so
an item's placeholders are not one run: the embedded span runs from the first frame's first
``<IMG_CONTEXT>`` to the last frame's last, and the encoder output of a video fills the text
between the frames with those tokens' own embeddings (``model.py``). Its ids come from the
tokenizer over the replacement text, as the reference tokenizes the expanded prompt.

Frames are resized with PIL (bicubic, as the image tiles); transformers' video processor
resizes with torchvision, which vlmd does not use, so the frames' pixels may differ from it by
rounding while the layout and counts are its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FrameLayout:
    """A video item's replacement ids and where its embedded span lies in them."""

    replacement: list[int]
    span_start: int  # the first frame's first placeholder
    span_length: int  # up to and including the last frame's last placeholder
    between: list[list[int]]  # the ids between frame i's placeholders and frame i + 1's


def frame_layout(tokenizer, num_frames: int, tokens_per_frame: int, context_token: str, start_token: str,
                 end_token: str, context_token_id: int) -> FrameLayout:
    if tokenizer is None:
        raise ValueError("InternVL video counts need the checkpoint's tokenizer (its frame labels are text)")
    frame = f"{start_token}{context_token * tokens_per_frame}{end_token}"
    text = "\n".join(f"Frame{index + 1}: {frame}" for index in range(num_frames))
    ids = tokenizer.encode(text, add_special_tokens=False)
    positions = [index for index, token in enumerate(ids) if token == context_token_id]
    if len(positions) != num_frames * tokens_per_frame:
        raise RuntimeError(f"the frame text of {num_frames} frames holds {len(positions)} placeholders")
    runs = [positions[index * tokens_per_frame : (index + 1) * tokens_per_frame] for index in range(num_frames)]
    between = [ids[runs[index][-1] + 1 : runs[index + 1][0]] for index in range(num_frames - 1)]
    return FrameLayout(ids, positions[0], positions[-1] - positions[0] + 1, between)


def interleave_frames(frame_features: list, between_embeddings: list):
    """One video's encoder output: frame 1's vectors, the embeddings of the text between
    frames 1 and 2, frame 2's vectors, ... (``frame_features``: one ``[tokens, hidden]``
    tensor per frame)."""
    import torch

    parts = [frame_features[0]]
    for gap, features in zip(between_embeddings, frame_features[1:]):
        parts.extend((gap.to(features.dtype), features))
    return torch.cat(parts)
