"""Qwen2.5-VL through the real server: greedy tokens equal transformers' generate.

Cases: one image; two images of different sizes; a 2 s video sampled at 2 fps (4 of its 16
frames kept, so each frame pair spans 1 s of absolute time); text only; a small image under a
per-request min_pixels/max_pixels; a second turn about the first case's image (its prefix
comes from the cache: ``cached_tokens``). All run concurrently on
one server; then again on a second server under ``--tensor-parallel-size 2`` whose token
budget (32) splits every image across steps, with a server-wide max_pixels and a KV cache
small enough to force preemption. ``usage.prompt_tokens`` must equal the length of
transformers' processor output; a first divergence is accepted only where transformers' own
top-1/top-2 log-prob gap is < 1e-3, and the log-probs of the greedy tokens must agree within
1e-3 up to it. Bad input gets the 4xx Qwen2-VL's does, and a good request follows.
"""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from conftest import Server, assert_refused_then_served, image_data_url, make_video, png_header_only, random_image, video_data_url
from oracle import assert_chat_parity
from oracle_qwen2_5_vl import hf_qwen2_5_vl_generate
from qwen2_5_vl_support import MEDIA_IO, sampled_video, video_bytes

SERVER_MAX_PIXELS = 64 * 28 * 28  # the second server's --mm-processor-kwargs
FIRST_ANSWER = "It is a picture of noise."


def _cases():
    data = video_bytes()
    frames, metadata = sampled_video(data)
    image = lambda seed, w, h: {"type": "image", "media": random_image(seed, w, h)}  # noqa: E731
    video = {"type": "video", "media": frames, "metadata": metadata, "url": video_data_url(data)}
    first = image(1, 640, 480)
    small = {"min_pixels": 24 * 28 * 28, "max_pixels": 48 * 28 * 28}  # per request: a small image grows
    return [
        ("one_image", [first], "What is in this image?", None, {}),
        ("two_images", [image(2, 500, 300), image(3, 96, 160)], "Compare them.", None, {}),
        ("video", [video], "What happens in the video?", None, {}),
        ("text_only", [], "Write a short poem about the sea.", None, {}),
        ("image_pixel_limits", [image(5, 80, 60)], "Describe it briefly.", None, small),
        ("second_turn", [first], "What is in this image?", "And what colour is it mostly?", {}),
    ]


def _messages(parts, text, follow_up, as_request: bool):
    content = []
    for part in parts:
        if not as_request:
            content.append({"type": part["type"]})
        elif part["type"] == "image":
            content.append({"type": "image_url", "image_url": {"url": image_data_url(part["media"])}})
        else:
            content.append({"type": "video_url", "video_url": {"url": part["url"]}})
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
    if follow_up is not None:
        messages += [{"role": "assistant", "content": FIRST_ANSWER},
                     {"role": "user", "content": [{"type": "text", "text": follow_up}]}]
    return messages


def _max_tokens(index: int) -> int:
    return 8 + 4 * index


def _body(case, index):
    _, parts, text, follow_up, kwargs = case
    body = {"messages": _messages(parts, text, follow_up, True), "max_tokens": _max_tokens(index), "temperature": 0,
            "return_token_ids": True, "logprobs": True}
    return {**body, "mm_processor_kwargs": kwargs} if kwargs else body


def _reference(model_dir, case, index, server_kwargs=None):
    """transformers' answer under the server-wide kwargs with the request's over them."""
    _, parts, text, follow_up, kwargs = case
    mm_processor_kwargs = {**(server_kwargs or {}), **kwargs}
    images = [part["media"] for part in parts if part["type"] == "image"]
    videos = [part for part in parts if part["type"] == "video"]
    return hf_qwen2_5_vl_generate(model_dir, _messages(parts, text, follow_up, False), images, _max_tokens(index),
                                  videos=[v["media"] for v in videos], video_metadata=[v["metadata"] for v in videos],
                                  mm_processor_kwargs=mm_processor_kwargs or None)


def _run_concurrently(server, cases):
    def one(index):
        status, body = server.chat(_body(cases[index], index))
        assert status == 200, body
        return body

    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(one, range(len(cases))))


@pytest.fixture(scope="module")
def cases():
    return _cases()


@pytest.fixture(scope="module")
def server(tiny_qwen2_5_vl_dir, tmp_path_factory):
    # A 512-token step budget: a quarter of the default's start-up profile, room for every case.
    server = Server(tiny_qwen2_5_vl_dir, "--limit-mm-per-prompt", "image=2,video=1", "--max-model-len", "1024",
                    "--max-num-batched-tokens", "512",
                    "--media-io-kwargs", orjson.dumps(MEDIA_IO).decode(),
                    log_dir=tmp_path_factory.mktemp("qwen2-5-vl-logs"))
    yield server
    server.stop()


def test_parity_concurrent_and_second_turn_cached(server, tiny_qwen2_5_vl_dir, cases):
    with ThreadPoolExecutor(2) as pool:  # references while the server answers
        answered = pool.submit(_run_concurrently, server, cases)
        refs = [_reference(tiny_qwen2_5_vl_dir, case, index) for index, case in enumerate(cases)]
        bodies = answered.result()
    for body, ref in zip(bodies, refs):
        assert_chat_parity(body, ref)
    # /tokenize counts as transformers' processor does (images, video, text).
    for index, (case, ref) in enumerate(zip(cases, refs)):
        request = {key: value for key, value in _body(case, index).items() if key in ("messages", "mm_processor_kwargs")}
        status, raw = server.request("POST", "/tokenize", orjson.dumps({"model": server.model, **request}))
        assert status == 200, raw
        assert orjson.loads(raw)["tokens"] == ref["prompt_token_ids"], case[0]
    # The second turn again, now that the first turn's prefix is cached: the image's blocks
    # come from the prefix cache and the answer is the same.
    index = len(cases) - 1
    status, body = server.chat(_body(cases[index], index))
    assert status == 200, body
    assert_chat_parity(body, refs[index])
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 8


def test_parity_tp2_split_placeholders_server_kwargs_and_preemption(tiny_qwen2_5_vl_dir, cases, tmp_path):
    server = Server(
        tiny_qwen2_5_vl_dir, "--tensor-parallel-size", "2", "--torch-threads", "1",
        "--limit-mm-per-prompt", "image=2,video=1", "--max-num-batched-tokens", "32", "--num-kv-blocks", "10",
        "--max-model-len", "160", "--mm-processor-kwargs", orjson.dumps({"max_pixels": SERVER_MAX_PIXELS}).decode(),
        # At most 4 frames (2 pairs of 64 tokens) leave room for text in 160 tokens; the test
        # video sampled at 2 fps keeps 4 either way.
        "--media-io-kwargs", orjson.dumps({"video": {**MEDIA_IO["video"], "num_frames": 4}}).decode(),
        log_dir=tmp_path,
    )
    try:
        refs = [_reference(tiny_qwen2_5_vl_dir, case, index, {"max_pixels": SERVER_MAX_PIXELS})
                for index, case in enumerate(cases)]
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


def _image_request(url: str, count: int = 1, **extra) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}] * count
    return {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": "What is it?"}]}],
            "max_tokens": 2, **extra}


def _video_request(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": "What happens?"}]}], "max_tokens": 2}


def _png_url(width: int, height: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_header_only(width, height)).decode()


@pytest.mark.parametrize(
    ("request_body", "message"),
    [
        (lambda: _image_request(image_data_url(random_image(1, 1, 1))), "too small"),
        (lambda: _image_request(_png_url(20_000, 20_000)), "image is too large"),
        (lambda: _image_request(image_data_url(random_image(1, 64, 64)), count=3), "at most 2 image"),
        (lambda: _video_request(video_data_url(make_video(24, 32, 32, fps=4))), "video is 6.0 s long; the limit is 5 s"),
        (lambda: _video_request(video_data_url(make_video(24, 32, 32, fps=8))), "video has 24 frames; the limit is 20"),
        (lambda: _image_request(image_data_url(random_image(1, 64, 64)), mm_processor_kwargs={"max_pixels": 10**7}),
         "exceeds this server's image limit"),
        (lambda: _image_request(image_data_url(random_image(1, 64, 64)), mm_processor_kwargs={"fps": 2}),
         "unknown mm_processor_kwargs"),
    ],
    ids=["1x1", "huge", "too-many-items", "video-too-long", "video-too-many-frames", "max-pixels-over-server",
         "unknown-kwarg"],
)
def test_bad_input_is_a_4xx_and_a_good_request_follows(server, request_body, message):
    good = _image_request(image_data_url(random_image(2, 200, 100)), mm_processor_kwargs={"max_pixels": 16 * 28 * 28})
    body = assert_refused_then_served(server, request_body(), message, good)
    assert body["usage"]["prompt_tokens_details"]["multimodal_tokens"]["image"] == 2 * 5  # 56x140 px


def test_structured_output_about_an_image(server):
    """The grammar mask runs on this family as on any: the answer is one of the choices."""
    options = ["a red square", "a green circle", "noise"]
    body = {**_image_request(image_data_url(random_image(4, 300, 200))), "max_tokens": 20,
            "structured_outputs": {"choice": options}, "temperature": 0}
    status, body = server.chat(body)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] in options
