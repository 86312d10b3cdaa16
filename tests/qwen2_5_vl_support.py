"""What both Qwen2.5-VL test modules share: the test video with the metadata transformers
is given (the tiny checkpoint is conftest's ``tiny_qwen2_5_vl_dir``). Not a test module."""

from __future__ import annotations

import io

import numpy as np
import torch

from conftest import make_video

# A 2 s clip at 8 fps, sampled at 2 fps (--media-io-kwargs {"video": {"fps": 2, "num_frames": 8}}):
# transformers' sample_frames keeps 4 of its 16 frames, [0, 4, 8, 12], 2 fps sampled, so a frame
# pair spans 1 s: 2 time positions at the tiny's 2 tokens per second.
VIDEO_FRAMES, VIDEO_FPS, SAMPLE_FPS, NUM_FRAMES, KEPT_FRAMES = 16, 8, 2, 8, 4
MEDIA_IO = {"video": {"num_frames": NUM_FRAMES, "fps": SAMPLE_FPS, "max_duration_s": 5, "max_frames": 20,
                      "max_bytes": 2**20}}


def video_bytes() -> bytes:
    return make_video(VIDEO_FRAMES, fps=VIDEO_FPS, seed=11)


def sampled_video(data: bytes, num_frames: int = KEPT_FRAMES) -> tuple[np.ndarray, dict]:
    """The frames transformers' ``sample_frames`` keeps (``arange(0, total, total / n).int()``)
    from an independent PyAV decode, and the ``VideoMetadata`` fields that go with them."""
    import av

    with av.open(io.BytesIO(data)) as container:
        rate = float(container.streams.video[0].average_rate)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    indices = torch.arange(0, len(frames), len(frames) / num_frames).int().tolist()
    metadata = {"total_num_frames": len(frames), "fps": rate, "frames_indices": indices}
    return np.stack([frames[i] for i in indices]), metadata
