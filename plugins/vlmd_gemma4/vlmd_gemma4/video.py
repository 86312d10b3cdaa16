"""Gemma 4 video: each kept frame through the image tower, under its ``mm:ss`` timestamp, as
transformers 5.25 does it (``Gemma4VideoProcessor``, ``Gemma4Processor.replace_video_token``,
``Gemma4Model.get_video_features``).

- Frames: the video processor's own sampler (``default_sample_indices_fn``): ``num_frames``
  indices ``i * total // num_frames`` (the server's ``--media-io-kwargs`` num_frames, else the
  checkpoint's, 32 by default), or with the server's fps ``max(1, int(total / rate x fps))`` of
  them (24 frames a second where the stream names no rate), at most num_frames; a video with
  fewer frames keeps them all (transformers refuses it).
- Pixels: every frame resized, aspect ratio kept, to the size an image of the same shape gets
  at the video processor's own budget (``max_soft_tokens``, 70 by default; a request's
  ``max_soft_tokens`` is the image processor's and leaves videos alone), then rescaled to [0, 1]
  as an image is. The resize is torchvision's on a uint8 tensor on the CPU (bicubic,
  antialiased): torch's own uint8 kernel, ``torch.nn.functional.interpolate``, which is what
  ``torchvision.transforms.v2.functional.resize`` calls there. PIL's bicubic, which the image
  path uses, differs from it by 1 in about 0.5% of the values, so frames do not go through it.
- Prompt: the template's ``<|video|>`` becomes, per frame, its time and its soft tokens in
  the image brackets, joined by spaces: ``00:00 <|image>`` + n x ``<|video|>`` + ``<image|>
  00:01 <|image>...<image|>``; a frame's time is its index in the source / the source's rate,
  written as minutes and whole seconds.
- Encoder: each frame's patches through the vision tower and the embedder exactly as an
  image's; the item's span runs from the first frame's first soft token to the last frame's
  last, and its encoder output fills the timestamp text between frames with those tokens' own
  embeddings (``vlmd.processing.frame_text``). Every row of a Gemma 4 item takes the pad
  token's per-layer embedding only where its id is a media token (``Gemma4Model.embed_input_ids``),
  so the text between frames keeps its own, as transformers computes it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlmd.errors import BadRequestError
from vlmd.processing.frame_text import DEFAULT_FPS
from vlmd_gemma4.settings import SUPPORTED_SOFT_TOKENS, ImageSettings

DEFAULT_NUM_FRAMES = 32  # Gemma4VideoProcessor.num_frames
DEFAULT_VIDEO_SOFT_TOKENS = 70  # Gemma4VideoProcessor.max_soft_tokens


@dataclass(frozen=True)
class VideoSettings:
    """The video processor's settings: each frame's (an image's at the video budget) and how
    many frames it keeps."""

    frame: ImageSettings
    num_frames: int = DEFAULT_NUM_FRAMES


def read_video_settings(model_dir: str, vision_config) -> VideoSettings:
    """``processor_config.json``'s ``video_processor`` (or ``video_preprocessor_config.json``),
    transformers' ``Gemma4VideoProcessor`` defaults where it says nothing, the tower's patch
    and pooling sizes where neither does."""
    raw: dict = {}
    combined = Path(model_dir) / "processor_config.json"
    alone = Path(model_dir) / "video_preprocessor_config.json"
    if combined.exists():
        raw = json.loads(combined.read_text(encoding="utf-8")).get("video_processor") or {}
    if not raw and alone.exists():
        raw = json.loads(alone.read_text(encoding="utf-8"))
    frame = ImageSettings(
        patch_size=int(raw.get("patch_size", vision_config.patch_size)),
        max_soft_tokens=int(raw.get("max_soft_tokens", DEFAULT_VIDEO_SOFT_TOKENS)),
        pooling_kernel_size=int(raw.get("pooling_kernel_size", vision_config.pooling_kernel_size)),
        resample=int(raw.get("resample", ImageSettings.resample)),
    )
    if frame.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        raise ValueError(f"{model_dir}: video max_soft_tokens {frame.max_soft_tokens} is not one of {SUPPORTED_SOFT_TOKENS}")
    if raw.get("do_normalize", True) and (raw.get("image_mean", [0.0] * 3) != [0.0] * 3
                                          or raw.get("image_std", [1.0] * 3) != [1.0] * 3):
        raise ValueError(f"{model_dir}: a Gemma 4 video normalised other than to [0, 1] is not supported")
    return VideoSettings(frame=frame, num_frames=int(raw.get("num_frames", DEFAULT_NUM_FRAMES)))


def sample_frame_indices(total: int, source_fps: float | None, num_frames: int, fps: float | None) -> list[int]:
    """transformers' ``default_sample_indices_fn`` (module docstring), at most ``total`` frames."""
    if total < 1:
        raise BadRequestError("a video must have at least one frame")
    count = num_frames
    if fps is not None:
        count = min(max(1, int(total / (source_fps or DEFAULT_FPS) * fps)), num_frames)
    count = min(count, total)
    return [index * total // count for index in range(count)]


def timestamp(seconds: float) -> str:
    """``Gemma4Processor.replace_video_token``'s ``mm:ss``."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def replacement_text(times: Sequence[float], tokens_per_frame: int, boi: str, eoi: str, video: str) -> str:
    """The text transformers puts in place of the template's video marker (tests compare it
    with transformers' own; the server builds the ids, ``frame_layout``)."""
    return " ".join(f"{timestamp(time)} {boi}{video * tokens_per_frame}{eoi}" for time in times)


@dataclass(frozen=True)
class FrameLayout:
    """A video item's replacement ids and where its embedded span and each frame lie in them."""

    replacement: list[int]
    span_start: int  # the first frame's first soft token
    span_length: int  # up to and including the last frame's last
    between: list[list[int]]  # the ids between frame i's soft tokens and frame i + 1's
    frame_starts: list[int]  # each frame's first soft token, from span_start


def frame_layout(encode: Callable[[str], list[int]], times: Sequence[float], tokens_per_frame: int,
                 boi_id: int, eoi_id: int, video_id: int) -> FrameLayout:
    """``replacement_text`` as ids: each timestamp tokenized on its own (special tokens on
    both sides of it but the first, which ``join_first_timestamps`` joins to the text before)."""
    ids: list[int] = []
    starts = []
    for index, time in enumerate(times):
        ids += encode(f"{timestamp(time)} " if index == 0 else f" {timestamp(time)} ")
        ids.append(boi_id)
        starts.append(len(ids))
        ids += [video_id] * tokens_per_frame
        ids.append(eoi_id)
    between = [ids[starts[i] + tokens_per_frame : starts[i + 1]] for i in range(len(starts) - 1)]
    return FrameLayout(ids, starts[0], starts[-1] + tokens_per_frame - starts[0], between,
                       [start - starts[0] for start in starts])


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 ``[frames, height, width, 3]``: torchvision's CPU uint8 bicubic antialiased resize
    (module docstring), the frames as they are where their size is already the target."""
    if frames.shape[1:3] == (height, width):
        return np.ascontiguousarray(frames)
    import torch

    with torch.inference_mode():
        tensor = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        resized = torch.nn.functional.interpolate(tensor, size=(height, width), mode="bicubic", antialias=True,
                                                  align_corners=False)
        return resized.permute(0, 2, 3, 1).contiguous().numpy()


def with_frames(settings: VideoSettings, num_frames: int | None) -> VideoSettings:
    """The settings with the server's num_frames (``--media-io-kwargs``), where it names one."""
    return settings if num_frames is None else dataclasses.replace(settings, num_frames=int(num_frames))
