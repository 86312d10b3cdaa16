"""Decode video bytes into uniformly sampled RGB frames with PyAV, under a MediaPolicy.

Bounded before any frame is decoded: container format, bytes, duration, total frame count,
frame size and the memory the kept frames will take. Decoding stops at the last sampled frame,
and only sampled frames are converted to RGB, so memory is ``frames kept x width x height x 3``
whatever the length of the video.

Frames are sampled as transformers' video processors do it: ``num_frames`` indices spread
uniformly from the first frame (index ``i * total // num_frames``), fewer when the video has
fewer frames, and an even count so frame pairs fill Qwen2-VL's temporal patch of 2 (a single
frame stays single; the processor repeats it). With ``fps`` set (--media-io-kwargs), the
count follows the video's length instead, as transformers' ``sample_frames(fps=...)``
counts it (``frames_to_keep``), still bounded by ``num_frames``.

The frames remember the rate they stand for (``VideoFrames.sampled_fps``: frames kept per
second of video, transformers' ``VideoMetadata.sampled_fps``), for families whose positions
follow absolute time, and which frames of the source they are at what rate
(``frame_indices``, ``source_fps``: transformers' ``frames_indices`` and ``fps``), for
families whose prompt writes each frame's time.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from fractions import Fraction

import numpy as np

from vlmd.errors import MediaError
from vlmd.media.fetch import fetch_bytes
from vlmd.media.policy import MediaPolicy

# FFmpeg demuxer names of the containers clients send. Probing accepts far more (image
# sequences, raw streams, playlists that name other files); refusing those keeps rarely
# exercised demuxers away from untrusted bytes and a PNG from passing as a one-frame video.
ALLOWED_CONTAINERS = frozenset(
    {"mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi", "mpegts", "mpeg", "ogg", "flv", "gif"}
)


class VideoFrames(np.ndarray):
    """``[frames, height, width, 3]`` uint8 RGB frames, an ndarray to every reader, that also
    carry ``sampled_fps``: kept frames per second of the source (kept / total x the stream's
    rate), None when the container names no rate; ``frame_indices``: each kept frame's index
    in the source (None: unknown); ``source_fps``: the stream's rate (None: unnamed)."""

    sampled_fps: float | None
    frame_indices: tuple[int, ...] | None
    source_fps: float | None

    @classmethod
    def of(cls, frames: np.ndarray, sampled_fps: float | None, frame_indices: tuple[int, ...] | None = None,
           source_fps: float | None = None) -> "VideoFrames":
        video = np.asarray(frames).view(cls)
        video.sampled_fps = sampled_fps
        video.frame_indices = None if frame_indices is None else tuple(int(index) for index in frame_indices)
        video.source_fps = source_fps
        return video

    def __array_finalize__(self, source) -> None:
        self.sampled_fps = getattr(source, "sampled_fps", None)
        self.frame_indices = getattr(source, "frame_indices", None)
        self.source_fps = getattr(source, "source_fps", None)


# (total frames, source rate or None) -> the indices to keep, increasing: a family's sampling.
FrameChooser = Callable[[int, "float | None"], list[int]]


def load_video(url: str, policy: MediaPolicy, choose: FrameChooser | None = None) -> np.ndarray:
    """Fetch ``url`` (data:, http(s)://, file://) and decode it; blocking, run off the loop."""
    data = fetch_bytes(url, dataclasses.replace(policy, max_bytes=policy.max_video_bytes))
    return decode_video(data, policy, choose=choose)


def decode_video(data: bytes, policy: MediaPolicy, num_frames: int | None = None,
                 choose: FrameChooser | None = None) -> np.ndarray:
    """``[frames, height, width, 3]`` uint8 RGB frames sampled from ``data``, or MediaError.
    ``choose`` picks the frames instead of the policy's uniform sampling (a family whose
    reference processor samples its own way: ``BaseProcessingInfo.video_frame_indices``)."""
    import av

    if not data:
        raise MediaError("video data is empty")
    container = _open(data)
    with container:
        stream = _video_stream(container)
        width, height = _check_frame_size(stream, policy)
        _check_duration(container, stream, policy)
        total = stream.frames if stream.frames > 0 else _count_frames(data, policy)
        rate = float(stream.average_rate) if stream.average_rate else None
        if total > policy.max_video_frames:
            raise MediaError(f"video has {total} frames; the limit is {policy.max_video_frames}")
        if total == 0:
            raise MediaError("video has no frames")
        if num_frames is not None:  # an explicit count overrides the policy's sampling
            indices = sample_frame_indices(total, even_frame_count(min(num_frames, total)))
        elif choose is not None:
            indices = [int(index) for index in choose(total, rate)]
            if not indices or indices[0] < 0 or indices[-1] >= total or any(
                    a >= b for a, b in zip(indices, indices[1:])):
                raise ValueError(f"a frame choice must be increasing indices below {total}, got {indices[:8]}...")
        else:
            indices = sample_frame_indices(total, frames_to_keep(total, rate, policy))
        count = len(indices)
        kept_bytes = count * width * height * 3
        if kept_bytes > policy.max_video_decoded_bytes:
            raise MediaError(
                f"{count} frames of {width}x{height} need {kept_bytes} bytes decoded; the limit is "
                f"{policy.max_video_decoded_bytes}: send a smaller video or ask for fewer frames"
            )
        try:
            frames = _decode_frames(container, stream, indices, width, height)
        except av.FFmpegError as exc:
            raise MediaError(f"cannot decode video: {_reason(exc)}") from None
    if not frames:
        raise MediaError("video has no decodable frames")
    # The header may promise more frames than the stream holds: keep what was decoded (an even
    # count of them, as the policy's sampling keeps).
    kept = np.stack(frames if len(frames) == len(indices) else frames[: even_frame_count(len(frames))])
    return VideoFrames.of(kept, None if rate is None else len(indices) / total * rate, indices[: len(kept)], rate)


# transformers' video processors sample at least this many frames by rate (their min_frames).
MIN_FRAMES_BY_RATE = 4


def frames_to_keep(total: int, source_fps: float | None, policy: MediaPolicy) -> int:
    """How many of a video's ``total`` frames the decoder keeps (``vlmd cost`` asks too).

    ``policy.video_num_frames`` of them, or with ``policy.video_fps`` set and a source rate
    known, that many per second of video counted as transformers' ``sample_frames(fps=...)``
    counts them: ``total / source_fps * fps`` frames, at least 4, at most ``video_num_frames``
    and the video's own frames, rounded down to an even count. Always an even count but for
    a lone frame.
    """
    if policy.video_fps is None or not source_fps:
        return even_frame_count(min(policy.video_num_frames, total))
    bound = min(policy.video_num_frames, total) // 2 * 2
    by_rate = total / source_fps * policy.video_fps
    count = int(min(max(by_rate, MIN_FRAMES_BY_RATE), bound, total)) // 2 * 2
    return max(count, min(total, 1))


def even_frame_count(count: int) -> int:
    """Round down to an even count (frame pairs), keeping a lone frame."""
    return count if count <= 1 else count - count % 2


def sample_frame_indices(total: int, count: int) -> list[int]:
    """``count`` indices spread uniformly over ``total`` frames, from the first one."""
    if not 0 < count <= total:
        raise ValueError(f"cannot sample {count} of {total} frames")
    return [index * total // count for index in range(count)]


def _open(data: bytes):
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.FFmpegError, ValueError, IndexError) as exc:
        raise MediaError(f"cannot read video data: {_reason(exc)}") from None
    if container.format.name not in ALLOWED_CONTAINERS:
        container.close()
        raise MediaError(
            f"unsupported video container {container.format.name!r}; send MP4, WebM/Matroska, "
            "AVI, MPEG-TS, Ogg, FLV or GIF"
        )
    return container


def _video_stream(container):
    if not container.streams.video:
        raise MediaError("the data has no video stream")
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"  # frame threads: decoding is the slow part
    return stream


def _check_frame_size(stream, policy: MediaPolicy) -> tuple[int, int]:
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    side = policy.min_image_side
    if width < side or height < side:
        raise MediaError(f"video frames are too small: {width}x{height}; the minimum is {side}x{side}")
    if width * height > policy.max_image_pixels:
        raise MediaError(f"video frames are too large ({width}x{height}): the limit is {policy.max_image_pixels} pixels")
    ratio = max(width, height) / min(width, height)
    if ratio > policy.max_image_aspect_ratio:
        raise MediaError(
            f"video aspect ratio is too extreme: {width}x{height} is {ratio:.0f}:1; "
            f"the limit is {policy.max_image_aspect_ratio:g}:1"
        )
    return width, height


def _check_duration(container, stream, policy: MediaPolicy) -> None:
    seconds = None
    if stream.duration and stream.time_base:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration:
        seconds = container.duration / 1_000_000  # AV_TIME_BASE units
    elif stream.frames and stream.average_rate:
        seconds = float(Fraction(stream.frames) / stream.average_rate)
    if seconds is not None and seconds > policy.max_video_duration_s:
        raise MediaError(f"video is {seconds:.1f} s long; the limit is {policy.max_video_duration_s:g} s")


def _count_frames(data: bytes, policy: MediaPolicy) -> int:
    """Frame count of a container whose header does not say (one packet per frame), found by
    demuxing without decoding; stops one past the limit."""
    import av

    container = _open(data)
    count = 0
    try:
        with container:
            for packet in container.demux(container.streams.video[0]):
                if packet.size:
                    count += 1
                    if count > policy.max_video_frames:
                        break
    except av.FFmpegError as exc:
        raise MediaError(f"cannot read video data: {_reason(exc)}") from None
    return count


def _decode_frames(container, stream, indices: list[int], width: int, height: int) -> list[np.ndarray]:
    wanted = set(indices)
    last = indices[-1]
    frames: list[np.ndarray] = []
    for index, frame in enumerate(container.decode(stream)):
        if index in wanted:
            if (frame.width, frame.height) == (width, height):
                frames.append(frame.to_ndarray(format="rgb24"))
            else:  # a stream may change size midway; kept frames take the header's size
                frames.append(frame.to_ndarray(format="rgb24", width=width, height=height))
        if index >= last:  # never past the last sampled frame, so never past max_video_frames
            break
    return frames


def _reason(exc: Exception) -> str:
    # FFmpeg messages carry the errno text and, for files, a path: keep the text only.
    text = getattr(exc, "strerror", None) or str(exc).strip() or type(exc).__name__
    return text[:200]


def resize_frames_chw(video, height: int, width: int, resample: int) -> np.ndarray:
    """uint8 ``[frames, 3, height, width]`` from decoded RGB frames ``[frames, H, W, 3]``, each
    resized with PIL (``resample`` as the family's image backend resizes), for families whose
    processor resizes every frame to one size (InternVL's tiles, Qwen3-VL's pairs)."""
    from PIL import Image

    from vlmd.errors import BadRequestError

    frames = np.asarray(video)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise BadRequestError("a video must decode to one or more RGB frames")
    out = np.empty((len(frames), 3, height, width), dtype=np.uint8)
    for index, frame in enumerate(frames):
        image = Image.fromarray(frame)
        if image.size != (width, height):
            image = image.resize((width, height), resample=resample, reducing_gap=None)
        out[index] = np.asarray(image).transpose(2, 0, 1)
    return out
