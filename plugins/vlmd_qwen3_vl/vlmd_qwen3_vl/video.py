"""Qwen3-VL video: frame pairs under their timestamps, as transformers writes them.

transformers' ``Qwen3VLVideoProcessor`` resizes all of a video's frames to one size chosen for
the whole video (its ``smart_resize`` counts the frames: the area of all frames together lies
within ``[min_pixels, max_pixels]``) and pairs them along time (temporal patch 2, an odd last
frame repeated). ``Qwen3VLProcessor`` then replaces the chat template's
``<|vision_start|><|video_pad|><|vision_end|>`` with, per frame pair, the pair's time as text
and its placeholders in their own brackets::

    <0.3 seconds><|vision_start|><|video_pad|>...<|vision_end|><1.3 seconds><|vision_start|>...

A pair's time is the mean of its frames' times (index in the source / the source's rate, 24
fps when the video names none), written with one decimal.

In vlmd the item's replacement holds all of it, and its embedded span runs from the first
pair's first placeholder to the last pair's last (``ProcessedItem.placeholder_offset`` and
``num_placeholders``, the mechanism InternVL's frame labels use): the encoder output fills the
text between pairs with those tokens' own embeddings and no DeepStack additions (``model.py``).
The template's wrapper goes as transformers drops it (``collapse_wrappers``), so a video adds
two tokens fewer to the templated prompt than its replacement holds (``prompt_tokens``).

Each timestamp is tokenized on its own (the item's replacement, cached per item); the
tokenizer splits the prompt at special tokens, so only the first timestamp can merge with
the text before it (a space or punctuation and ``<``: one token in Qwen's vocabulary), and
``join_first_timestamps`` tokenizes that text and the first timestamp together, as
transformers tokenizes the expanded prompt.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vlmd.errors import BadRequestError
from vlmd.processing.frame_text import DEFAULT_FPS, frame_times, interleave_rows, join_first_timestamps

__all__ = ["DEFAULT_FPS", "frame_times", "interleave_rows", "join_first_timestamps"]  # shared with Gemma 4


def smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """(height, width) of every frame: transformers' Qwen3-VL video ``smart_resize``, whose
    limits bound the pixels of all frames together."""
    if num_frames < temporal_factor:
        raise BadRequestError(f"a Qwen3-VL video needs at least {temporal_factor} frames; this one has {num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise BadRequestError(f"aspect ratio of {width}x{height} is over 200:1, which Qwen3-VL cannot take")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def capped_max_pixels(num_frames: int, min_pixels: int, max_pixels: int, factor: int,
                      max_video_tokens: int | None) -> int:
    """``max_pixels`` under ``cap_pixels_per_frame`` (None: no cap, transformers' default):
    each frame at most ``max_video_tokens`` merged patches or its share of the budget, and
    at least 1.05 x ``min_pixels``."""
    if max_video_tokens is None:
        return max_pixels
    per_frame = max(min(max_video_tokens * factor * factor, max_pixels // num_frames), int(min_pixels * 1.05))
    return per_frame * num_frames




def pair_times(times: Sequence[float], temporal: int) -> list[float]:
    """Each frame pair's time: the mean of its first and last frame's (transformers'
    ``_calculate_timestamps``; an odd last frame is repeated, as the pixels are)."""
    times = list(times)
    times += times[-1:] * (-len(times) % temporal)
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


@dataclass(frozen=True)
class FrameLayout:
    """A video item's replacement ids and where its embedded span lies in them."""

    replacement: list[int]
    span_start: int  # the first pair's first placeholder
    span_length: int  # up to and including the last pair's last placeholder
    between: list[list[int]]  # the ids between pair i's placeholders and pair i + 1's


def frame_layout(timestamp_ids: Callable[[str], list[int]], times: Sequence[float], tokens_per_pair: int,
                 start_id: int, end_id: int, pad_id: int) -> FrameLayout:
    """``<t seconds><|vision_start|>`` + placeholders + ``<|vision_end|>`` per pair time."""
    ids: list[int] = []
    runs = []
    for time in times:
        ids += timestamp_ids(f"<{time:.1f} seconds>")
        ids.append(start_id)
        runs.append(len(ids))
        ids += [pad_id] * tokens_per_pair
        ids.append(end_id)
    between = [ids[runs[i] + tokens_per_pair : runs[i + 1]] for i in range(len(runs) - 1)]
    return FrameLayout(ids, runs[0], runs[-1] + tokens_per_pair - runs[0], between)


def collapse_wrappers(prompt_ids: list[int], start_id: int, pad_id: int, end_id: int) -> list[int]:
    """The prompt with each ``<|vision_start|><|video_pad|><|vision_end|>`` turned into a bare
    ``<|video_pad|>``: the expansion brackets every frame pair itself (transformers'
    ``Qwen3VLProcessor.get_text_with_replacements``). A bare marker stays as it is."""
    out: list[int] = []
    index = 0
    while index < len(prompt_ids):
        if prompt_ids[index : index + 3] == [start_id, pad_id, end_id]:
            out.append(pad_id)
            index += 3
        else:
            out.append(prompt_ids[index])
            index += 1
    return out
