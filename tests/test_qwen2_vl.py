"""Qwen2-VL through the real server: greedy tokens equal transformers' generate.

Cases: a 640x480 image; a very wide and a very tall image; three images in one prompt; a
short PyAV video (by file:// and by data: URL, alone and beside two images); text only; a
per-request max_pixels. Each runs alone, then all 8 concurrently, then again on a second
server whose token budget (32) splits every image's placeholders across steps, with a
server-wide --mm-processor-kwargs and a KV cache small enough to force preemption.
``usage.prompt_tokens`` must equal the length of transformers' processor output. A first
divergence is accepted only where transformers' own top-1/top-2 log-prob gap is < 1e-3, and
the log-probs of the greedy tokens must agree within 1e-3 up to it (a position error that
leaves the argmax alone still moves them).

Videos are sampled (8 of 16 frames) by the test itself from an independent PyAV decode, with
the indices transformers' ``sample_frames`` computes.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import av
import numpy as np
import orjson
import pytest
import torch

from conftest import Server, image_data_url, make_video, random_image, video_data_url
from oracle import assert_chat_parity, hf_qwen2_vl_generate

NUM_FRAMES = 8
SERVER_MAX_PIXELS = 64 * 28 * 28  # the split server's --mm-processor-kwargs


def reference_frames(data: bytes, num_frames: int) -> np.ndarray:
    """Frames transformers would sample: ``arange(0, total, total / n).int()``."""
    with av.open(io.BytesIO(data)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    count = min(num_frames, len(frames))
    count -= count % 2 if count > 1 else 0
    indices = torch.arange(0, len(frames), len(frames) / count).int().tolist()
    return np.stack([frames[i] for i in indices])


@pytest.fixture(scope="module")
def video_file(media_dir):
    data = make_video(16, seed=7)
    path = media_dir / "qwen2-vl-clip.mp4"
    path.write_bytes(data)
    return path, data


CASE_NAMES = ["image_640x480", "wide_1500x200", "tall_200x1500", "three_images", "video_file_url",
              "images_and_video", "text_only", "image_max_pixels"]


def _cases(video_file):
    path, data = video_file
    frames = reference_frames(data, NUM_FRAMES)
    image = lambda seed, w, h: {"type": "image", "media": random_image(seed, w, h)}  # noqa: E731
    file_video = {"type": "video", "media": frames, "url": path.as_uri()}
    data_video = {"type": "video", "media": frames, "url": video_data_url(data)}
    cases = {
        "image_640x480": ([image(1, 640, 480)], "What is in this image?", {}),
        "wide_1500x200": ([image(2, 1500, 200)], "Read the banner.", {}),
        "tall_200x1500": ([image(3, 200, 1500)], "Describe the tall picture.", {}),
        "three_images": ([image(4, 320, 240), image(5, 500, 300), image(6, 96, 128)], "Compare them.", {}),
        "video_file_url": ([file_video], "What happens in the video?", {}),
        "images_and_video": ([image(8, 300, 200), data_video, image(9, 128, 96)], "Which came first?", {}),
        "text_only": ([], "Write a short poem about the sea.", {}),
        "image_max_pixels": ([image(10, 800, 600)], "Describe it briefly.", {"max_pixels": 16 * 28 * 28}),
    }
    assert list(cases) == CASE_NAMES
    return cases


def _body(parts, text, kwargs, max_tokens):
    content = []
    for part in parts:
        if part["type"] == "image":
            content.append({"type": "image_url", "image_url": {"url": image_data_url(part["media"])}})
        else:
            content.append({"type": "video_url", "video_url": {"url": part["url"]}})
    content.append({"type": "text", "text": text})
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "logprobs": True}
    if kwargs:
        body["mm_processor_kwargs"] = kwargs
    return body


def _reference(model_dir, parts, text, kwargs, max_tokens):
    content = [{"type": part["type"]} for part in parts] + [{"type": "text", "text": text}]
    images = [part["media"] for part in parts if part["type"] == "image"]
    videos = [part["media"] for part in parts if part["type"] == "video"]
    return hf_qwen2_vl_generate(model_dir, [{"role": "user", "content": content}], images, max_tokens,
                                videos=videos, mm_processor_kwargs=kwargs)


def _max_tokens(index: int) -> int:
    return 8 + 4 * index


@pytest.fixture(scope="module")
def cases(video_file):
    return list(_cases(video_file).items())


@pytest.fixture(scope="module")
def references(tiny_qwen2_vl_dir, cases):
    return {name: _reference(tiny_qwen2_vl_dir, *case, _max_tokens(i)) for i, (name, case) in enumerate(cases)}


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl_dir, media_dir, tmp_path_factory):
    server = Server(
        tiny_qwen2_vl_dir, "--allowed-local-media-path", str(media_dir), "--limit-mm-per-prompt", "image=3,video=1",
        "--max-model-len", "4096", "--media-io-kwargs",
        orjson.dumps({"video": {"num_frames": NUM_FRAMES, "max_duration_s": 5, "max_bytes": 2**20}}).decode(),
        log_dir=tmp_path_factory.mktemp("qwen2-vl-logs"),
    )
    yield server
    server.stop()


def _run_concurrently(server, cases):
    def one(index):
        status, body = server.chat(_body(*cases[index][1], _max_tokens(index)))
        assert status == 200, body
        return body

    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(one, range(len(cases))))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_parity_one_request(server, cases, references, name):
    index = CASE_NAMES.index(name)
    status, body = server.chat(_body(*cases[index][1], _max_tokens(index)))
    assert status == 200, body
    assert_chat_parity(body, references[name])


def test_parity_mixed_batch_of_8(server, cases, references):
    assert len(cases) == 8
    for (name, _), body in zip(cases, _run_concurrently(server, cases)):
        assert_chat_parity(body, references[name])


def test_parity_split_placeholders_server_kwargs_and_preemption(tiny_qwen2_vl_dir, media_dir, cases, tmp_path):
    server = Server(
        tiny_qwen2_vl_dir, "--allowed-local-media-path", str(media_dir), "--limit-mm-per-prompt", "image=3,video=1",
        "--max-num-batched-tokens", "32", "--num-kv-blocks", "20", "--max-model-len", "320",
        # Two intra-op threads, as when tuned: preemption needs the requests to overlap.
        "--torch-threads", "2",
        "--mm-processor-kwargs", orjson.dumps({"max_pixels": SERVER_MAX_PIXELS}).decode(),
        "--media-io-kwargs", orjson.dumps({"video": {"num_frames": NUM_FRAMES}}).decode(), log_dir=tmp_path,
    )
    try:
        refs = [
            _reference(tiny_qwen2_vl_dir, parts, text, {"max_pixels": SERVER_MAX_PIXELS, **kwargs}, _max_tokens(index))
            for index, (_, (parts, text, kwargs)) in enumerate(cases)
        ]
        # Preemption needs the requests to overlap, which depends on when each one's
        # preprocessing ends on a loaded host: every round is checked, at most three are sent.
        for _ in range(3):
            steps_before = server.metrics()["vlmd_engine_steps_total"]
            bodies = _run_concurrently(server, cases)
            for body, ref in zip(bodies, refs):
                assert_chat_parity(body, ref)
            metrics = server.metrics()
            prompt_tokens = sum(body["usage"]["prompt_tokens"] for body in bodies)
            assert metrics["vlmd_engine_steps_total"] - steps_before >= prompt_tokens // 32
            if metrics["vlmd_num_preemptions_total"] > 0:
                break
        assert metrics["vlmd_num_preemptions_total"] > 0, "the test meant to force preemption"
    finally:
        server.stop()


def _video_request(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": "What happens?"}]}], "max_tokens": 2}


def _zero_frame_avi() -> bytes:
    buffer = io.BytesIO()
    container = av.open(buffer, "w", format="avi")
    stream = container.add_stream("mpeg4", rate=4)
    stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
    container.start_encoding()
    container.close()
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("make_url", "message"),
    [
        (lambda: video_data_url(b"this is not a video" * 40), "cannot read video data"),
        (lambda: image_data_url(random_image(1, 64, 64)), "unsupported video container"),
        (lambda: video_data_url(_zero_frame_avi(), "video/x-msvideo"), "video has no frames"),
        (lambda: video_data_url(make_video(12, 32, 32, fps=2)), "video is 6.0 s long; the limit is 5 s"),
        (lambda: "data:video/mp4;base64," + base64.b64encode(bytes(2**20 + 1)).decode(), "media size limit"),
    ],
    ids=["not-a-video", "an-image", "zero-frames", "too-long", "too-many-bytes"],
)
def test_bad_video_is_a_400(server, make_url, message):
    status, body = server.chat(_video_request(make_url()))
    assert status == 400, body
    assert message in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"


def test_request_limits_are_400s(server, video_file):
    _, data = video_file
    url = video_data_url(data)
    two_videos = _video_request(url)
    two_videos["messages"][0]["content"].insert(0, {"type": "video_url", "video_url": {"url": url}})
    status, body = server.chat(two_videos)
    assert status == 400 and "at most 1 video" in body["error"]["message"]
    status, body = server.chat({**_video_request(url), "mm_processor_kwargs": {"max_pixels": 10**7}})
    assert status == 400 and "exceeds this server's video limit" in body["error"]["message"]
    status, body = server.chat({**_video_request(url), "mm_processor_kwargs": {"fps": 1}})
    assert status == 400 and body["error"]["param"] == "mm_processor_kwargs"
    status, body = server.chat(_video_request(url))  # and the server still serves
    assert status == 200 and body["usage"]["prompt_tokens"] > 4 * 12


def test_a_video_by_uuid_alone_gets_the_tokens_its_bytes_got(server):
    """vLLM's item uuid on a video part (docs/decisions.md, D102): the second request names
    the video by its uuid only; nothing is fetched or decoded, and the answer is the same."""
    part = {"type": "video_url", "video_url": {"url": video_data_url(make_video(8, seed=21))}, "uuid": "clip-21"}
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    status, first = server.chat({**body, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}]})
    assert status == 200, first
    before = server.metrics()
    status, again = server.chat({**body, "messages": [{"role": "user", "content": [
        {"type": "video_url", "uuid": "clip-21"}, {"type": "text", "text": "What happens?"}]}]})
    after = server.metrics()
    assert status == 200, again
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert again["prompt_token_ids"] == first["prompt_token_ids"]
    name = 'vlmd_media_fetch_seconds_count{modality="video"}'
    assert after.get(name, 0.0) == before.get(name, 0.0)
    assert after["vlmd_encoder_forwards_total"] == before["vlmd_encoder_forwards_total"]
