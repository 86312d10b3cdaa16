"""A video's frames under their timestamps, in the prompt and in the encoder output.

Some families write each kept frame's time as text in front of its placeholders (Qwen3-VL's
``<t seconds>`` per frame pair, Gemma 4's ``mm:ss`` per frame), so one video item's
replacement holds text between its frames' placeholder runs. Its embedded span runs from the
first frame's first placeholder to the last frame's last (``ProcessedItem.placeholder_offset``
and ``num_placeholders``), and its encoder output fills the text rows inside the span with
those tokens' own embeddings (``interleave_rows``). The times come from the decoder's kept
frame indices and the stream's rate (``frame_times``); each timestamp is tokenized on its own,
which is how transformers' whole-prompt tokenization splits it at the special tokens around
it, except the first, which ``join_first_timestamps`` tokenizes with the text before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

DEFAULT_FPS = 24  # transformers' rate for a video whose metadata names none


class TimestampIds:
    """The ids of one timestamp's text, tokenized on its own, once per text (a family's
    processing info holds one; ``family`` names it in the error without a tokenizer)."""

    def __init__(self, tokenizer: Any, family: str):
        self.tokenizer = tokenizer
        self.family = family
        self._ids: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        ids = self._ids.get(text)
        if ids is None:
            if self.tokenizer is None:
                raise ValueError(f"{self.family} video counts need the checkpoint's tokenizer (its timestamps are text)")
            ids = self._ids[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return ids


def frame_times(video: Any) -> tuple[float, ...]:
    """Each frame's time in seconds, as transformers computes it from ``VideoMetadata``:
    the decoder's ``frame_indices`` and ``source_fps`` (``vlmd.media.video.VideoFrames``);
    frames that name neither count as frames 0, 1, ... at 24 fps."""
    indices = getattr(video, "frame_indices", None) or range(len(video))
    fps = getattr(video, "source_fps", None) or DEFAULT_FPS
    return tuple(index / fps for index in indices)


def join_first_timestamps(prompt_ids: list[int], items: list, first_timestamps: dict[int, str],
                          encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                          boundaries: set[int]) -> tuple[list[int], list]:
    """(prompt ids, items) with each video's first timestamp tokenized together with the text
    before it, back to the previous special token (``boundaries``), where that differs from
    the two tokenized apart; later items move by the difference. ``first_timestamps``: item
    index -> that video's first timestamp text; its ids end right before the token that
    opens the first frame (pair), one token before the item's offset."""
    ids, out, shift = list(prompt_ids), [], 0
    for index, item in enumerate(items):
        if shift:
            item = dataclasses.replace(item, offset=item.offset + shift)
        text = first_timestamps.get(index)
        if text is not None:
            end = item.offset - 1  # the token opening the first frame (pair): Qwen's <|vision_start|>, Gemma's <|image>
            start = end - len(encode(text))
            begin = start
            while begin > 0 and ids[begin - 1] not in boundaries:
                begin -= 1
            if begin < start:
                joined = encode(decode(ids[begin:start]) + text)
                if joined != ids[begin:end]:
                    delta = len(joined) - (end - begin)
                    ids[begin:end] = joined
                    item = dataclasses.replace(item, offset=item.offset + delta)
                    shift += delta
        out.append(item)
    return ids, out


def with_first_timestamps_joined(output: Any, videos: list[Any], first_text: Callable[[Any], str], tokenizer: Any,
                                 family_state: Callable[[list[int], list], Any]) -> Any:
    """A ``ProcessorOutput`` with each video's first timestamp (``first_text(video)``, the
    videos in prompt order) tokenized together with the text before it
    (``join_first_timestamps``), as transformers tokenizes the expanded prompt; the family
    state made again where the ids changed. Unchanged without a tokenizer."""
    from vlmd.processing.base import ProcessorOutput

    if tokenizer is None or not videos:
        return output
    videos = iter(videos)
    first = {index: first_text(next(videos)) for index, item in enumerate(output.items) if item.modality == "video"}
    ids, items = join_first_timestamps(
        output.prompt_token_ids, output.items, first, lambda text: tokenizer.encode(text, add_special_tokens=False),
        lambda ids: tokenizer.decode(ids, clean_up_tokenization_spaces=False), set(tokenizer.added_tokens_decoder))
    if ids == output.prompt_token_ids:
        return output
    return ProcessorOutput(ids, items, family_state(ids, items))


def interleave_rows(pair_rows: list, between: list, width: int):
    """One video's encoder output: frame (pair) 1's rows, the rows of the text between frames
    1 and 2 (its embeddings, zero past their width: Qwen3-VL's DeepStack parts, which the
    reference adds at placeholders only), frame 2's rows, ... ``between`` holds ``[tokens,
    hidden]`` embeddings."""
    import torch

    parts = [pair_rows[0]]
    for gap, rows in zip(between, pair_rows[1:]):
        text = torch.zeros(gap.shape[0], width, dtype=rows.dtype, device=rows.device)
        text[:, : gap.shape[1]] = gap.to(rows.dtype)
        parts.extend((text, rows))
    return torch.cat(parts)

