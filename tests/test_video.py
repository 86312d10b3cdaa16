"""Video decoding (vlmd/media/video.py): uniform frame sampling, containers, and every bound
answered with a MediaError (a 400) before frames are decoded, never an out-of-memory."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from PIL import Image

from conftest import make_video
from vlmd.config import media_policy_fields
from vlmd.errors import MediaError
from vlmd.media.policy import MediaPolicy
from vlmd.media.video import decode_video, even_frame_count, load_video, sample_frame_indices

POLICY = MediaPolicy(video_num_frames=8)


def all_frames(data: bytes) -> list[np.ndarray]:
    """Every frame, decoded independently of the code under test."""
    with av.open(io.BytesIO(data)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


@pytest.fixture(scope="module")
def video16() -> bytes:
    return make_video(16)


def test_samples_frames_uniformly_from_the_first(video16):
    frames = decode_video(video16, POLICY)
    reference = all_frames(video16)
    assert frames.shape == (8, 84, 112, 3) and frames.dtype == np.uint8
    for got, index in zip(frames, range(0, 16, 2)):
        assert np.array_equal(got, reference[index])


@pytest.mark.parametrize(("total", "wanted", "expected"), [(16, 8, 8), (7, 32, 6), (1, 32, 1), (3, 2, 2)])
def test_fewer_frames_than_asked_and_an_even_count(total, wanted, expected):
    frames = decode_video(make_video(total, 32, 32), POLICY, num_frames=wanted)
    assert len(frames) == expected


def test_sampling_arithmetic():
    assert sample_frame_indices(16, 8) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert sample_frame_indices(10, 6) == [0, 1, 3, 5, 6, 8]
    assert sample_frame_indices(5, 5) == [0, 1, 2, 3, 4]
    assert [even_frame_count(n) for n in (0, 1, 2, 3, 8, 9)] == [0, 1, 2, 2, 8, 8]
    with pytest.raises(ValueError):
        sample_frame_indices(3, 4)


@pytest.mark.parametrize(("fmt", "codec"), [("matroska", "mpeg4"), ("avi", "mpeg4"), ("webm", "libvpx")])
def test_other_containers(fmt, codec):
    assert decode_video(make_video(4, 32, 32, fmt=fmt, codec=codec), POLICY).shape == (4, 32, 32, 3)


def _zero_frame_avi() -> bytes:
    buffer = io.BytesIO()
    container = av.open(buffer, "w", format="avi")
    stream = container.add_stream("mpeg4", rate=4)
    stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
    container.start_encoding()
    container.close()
    return buffer.getvalue()


def _audio_only() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mpegts") as container:
        stream = container.add_stream("mp2", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1152), dtype=np.int16), format="s16", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return buffer.getvalue()


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (1, 2, 3)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("make", "policy", "message"),
    [
        (lambda: b"", POLICY, "video data is empty"),
        (lambda: b"this is not a video" * 50, POLICY, "cannot read video data"),
        (_png, POLICY, "unsupported video container 'png_pipe'"),
        (_zero_frame_avi, POLICY, "video has no frames"),
        (_audio_only, POLICY, "no video stream"),
        (lambda: make_video(12, 32, 32, fps=2), MediaPolicy(max_video_duration_s=5), "video is 6.0 s long; the limit is 5 s"),
        (lambda: make_video(12, 32, 32), MediaPolicy(max_video_frames=10), "video has 12 frames; the limit is 10"),
        (lambda: make_video(4, 64, 64), MediaPolicy(max_video_decoded_bytes=4 * 64 * 64 * 3 - 1), "bytes decoded"),
        (lambda: make_video(2, 64, 48), MediaPolicy(max_image_pixels=64 * 48 - 1), "video frames are too large"),
    ],
    ids=["empty", "not-a-video", "png", "zero-frames", "audio-only", "too-long", "too-many-frames",
         "too-much-memory", "frames-too-large"],
)
def test_bad_videos_are_media_errors(make, policy, message):
    with pytest.raises(MediaError, match=message):
        decode_video(make(), policy)


def test_load_video_file_url_and_byte_limit(tmp_path, video16):
    path = tmp_path / "clip.mp4"
    path.write_bytes(video16)
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path), video_num_frames=4)
    assert load_video(path.as_uri(), policy).shape == (4, 84, 112, 3)
    # Videos have their own byte cap, separate from images'.
    small = MediaPolicy(allowed_local_media_path=str(tmp_path), max_bytes=10, max_video_bytes=len(video16) - 1)
    with pytest.raises(MediaError, match="larger than the media size limit"):
        load_video(path.as_uri(), small)
    outside = MediaPolicy(allowed_local_media_path=str(tmp_path / "elsewhere"))
    with pytest.raises(MediaError, match="outside --allowed-local-media-path"):
        load_video(path.as_uri(), outside)


def test_load_video_over_http_under_the_url_policy(video16):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(video16)))
            self.end_headers()
            self.wfile.write(video16)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/clip.mp4"
    try:
        assert load_video(url, MediaPolicy(allow_private_urls=True, video_num_frames=2)).shape == (2, 84, 112, 3)
        with pytest.raises(MediaError, match="private, loopback"):
            load_video(url, MediaPolicy())  # the same SSRF policy as images
    finally:
        server.shutdown()
        server.server_close()


def test_media_io_kwargs_map_to_policy_fields():
    fields = media_policy_fields({"video": {"num_frames": 16, "max_duration_s": 30, "max_bytes": 1000}})
    assert fields == {"video_num_frames": 16, "max_video_duration_s": 30, "max_video_bytes": 1000}
    assert MediaPolicy(**fields).video_num_frames == 16
    assert media_policy_fields({"video": {"fps": 2}}) == {"video_fps": 2}
    for bad in ({"video": {"frame_rate": 2}}, {"audio": {}}, {"video": {"num_frames": "8"}}):
        with pytest.raises(ValueError):
            media_policy_fields(bad)
    with pytest.raises(ValueError):
        MediaPolicy(video_num_frames=0)
    with pytest.raises(ValueError):
        MediaPolicy(video_fps=0)
