"""Qwen3-VL (dense) through the real server: greedy tokens equal transformers' generate.

Cases: a 640x480 image; two images of different sizes; a very wide image; text only; a
per-request max_pixels; a second turn about the first case's image; a 4 s video (8 of its 16
frames kept at the checkpoint's 2 fps, four frame pairs under their timestamps); a video and
an image. Each runs alone,
then all concurrently, then again on a second server, under ``--tensor-parallel-size 2``,
whose token budget (16) splits every image's and every video's placeholders (and so their
DeepStack rows, and a video's timestamp text between its pairs) across steps and whose KV
cache (14 blocks of 16) forces preemption. transformers gets every frame (an independent PyAV
decode) with the source rate and samples them itself (tests/qwen3_vl_oracle.py). The second turn finds its first
turn's blocks in the prefix cache (``cached_tokens``); an image after new text takes its
encoder output from the encoder cache; a prefix hit that ends inside an image computes the
rest of it. ``usage.prompt_tokens`` and /tokenize must equal transformers' processor output;
a first divergence is accepted only at a near tie (tests/oracle.py), and the greedy tokens'
log-probs must agree within 1e-3 up to it.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pytest
from PIL import Image

from conftest import Server, image_data_url, make_video, random_image, video_data_url
from oracle import assert_chat_parity
from qwen3_vl_oracle import hf_qwen3_vl_generate
from test_bad_input import png_header_only

CASE_NAMES = ["image_640x480", "two_images", "wide_1500x200", "text_only", "image_max_pixels", "second_turn",
              "video", "video_and_image"]
FIRST_ANSWER = "It is a picture of noise."
NUM_FRAMES, MAX_FRAMES = 8, 20  # the servers' --media-io-kwargs: frames kept, most frames a video may have
SAMPLE_FPS = 2  # the tiny checkpoint's (Qwen3VLVideoProcessor's default) frames per second of video
MEDIA_IO = '{"video": {"num_frames": %d, "max_frames": %d}}' % (NUM_FRAMES, MAX_FRAMES)


def decoded_video(frames: int, width: int, height: int, fps: int, seed: int) -> dict:
    """A video part: its bytes, every frame from an independent PyAV decode, and the
    ``VideoMetadata`` transformers samples them by (its 2 fps keep at most ``NUM_FRAMES``
    of these videos, the server's bound)."""
    import av

    data = make_video(frames, width, height, fps=fps, seed=seed)
    with av.open(io.BytesIO(data)) as container:
        rate = float(container.streams.video[0].average_rate)
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert int(len(decoded) / rate * SAMPLE_FPS) <= NUM_FRAMES
    return {"type": "video", "media": np.stack(decoded), "metadata": {"total_num_frames": len(decoded), "fps": rate},
            "url": video_data_url(data)}


def _cases():
    image = lambda seed, w, h: {"type": "image", "media": random_image(seed, w, h)}  # noqa: E731
    first = [image(1, 640, 480)]
    # Frames at a multiple of 32 px within the video limits: no resize (the oracle resizes none).
    video = decoded_video(16, 128, 96, fps=4, seed=3)
    other_video = decoded_video(12, 96, 64, fps=3, seed=4)
    cases = {
        "image_640x480": (first, "What is in this image?", {}, None),
        "two_images": ([image(4, 320, 240), image(5, 500, 300)], "Compare them.", {}, None),
        "wide_1500x200": ([image(2, 1500, 200)], "Read the banner.", {}, None),
        "text_only": ([], "Write a short poem about the sea.", {}, None),
        "image_max_pixels": ([image(10, 800, 600)], "Describe it briefly.", {"max_pixels": 16 * 32 * 32}, None),
        # The first case's conversation, one turn on: its prompt starts with the first's.
        "second_turn": (first, "What is in this image?", {}, (FIRST_ANSWER, "And its colours?")),
        "video": ([video], "What happens in the video?", {}, None),
        "video_and_image": ([other_video, image(6, 320, 240)], "Does the picture come from the video?", {}, None),
    }
    assert list(cases) == CASE_NAMES
    return cases


def _messages(parts, text, follow_up, content_of):
    messages = [{"role": "user", "content": [content_of(part) for part in parts] + [{"type": "text", "text": text}]}]
    if follow_up is not None:
        answer, question = follow_up
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": [{"type": "text", "text": question}]}]
    return messages


def _content(part) -> dict:
    if part["type"] == "video":
        return {"type": "video_url", "video_url": {"url": part["url"]}}
    return {"type": "image_url", "image_url": {"url": image_data_url(part["media"])}}


def _body(parts, text, kwargs, follow_up, max_tokens):
    body = {"messages": _messages(parts, text, follow_up, _content), "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "logprobs": True}
    if kwargs:
        body["mm_processor_kwargs"] = kwargs
    return body


def _reference(model_dir, parts, text, kwargs, follow_up, max_tokens):
    messages = _messages(parts, text, follow_up, lambda part: {"type": part["type"]})
    videos = [part for part in parts if part["type"] == "video"]
    return hf_qwen3_vl_generate(model_dir, messages, [part["media"] for part in parts if part["type"] == "image"],
                                max_tokens, mm_processor_kwargs=kwargs, videos=[video["media"] for video in videos],
                                video_metadata=[video["metadata"] for video in videos], sample_fps=SAMPLE_FPS)


def _max_tokens(index: int) -> int:
    return 8 + 2 * index


@pytest.fixture(scope="module")
def cases():
    return list(_cases().items())


@pytest.fixture(scope="module")
def references(tiny_qwen3_vl_dir, cases):
    return {name: _reference(tiny_qwen3_vl_dir, *case, _max_tokens(i)) for i, (name, case) in enumerate(cases)}


# --max-num-seqs and the token budgets bound the start-up profile (as many largest images as
# the encoder budget takes, beside a full prefill): seconds of this module's time.
MAIN_FLAGS = ("--limit-mm-per-prompt", "image=2,video=1", "--max-model-len", "1024", "--max-num-seqs", "8",
              "--max-num-batched-tokens", "256", "--media-io-kwargs", MEDIA_IO)
SPLIT_FLAGS = ("--tensor-parallel-size", "2", "--torch-threads", "1", "--limit-mm-per-prompt", "image=2,video=1",
               "--max-num-batched-tokens", "16", "--max-num-seqs", "8", "--num-kv-blocks", "14",
               "--max-model-len", "200", "--media-io-kwargs", MEDIA_IO)


@pytest.fixture(scope="module")
def launched(tiny_qwen3_vl_dir, tmp_path_factory):
    """Both servers, starting while the references are computed (start-up is mostly one
    thread's imports and loading): futures of (main, split)."""
    logs = tmp_path_factory.mktemp("qwen3-vl-logs")
    pool = ThreadPoolExecutor(2)
    futures = {name: pool.submit(Server, tiny_qwen3_vl_dir, *flags, log_dir=logs)
               for name, flags in (("main", MAIN_FLAGS), ("split", SPLIT_FLAGS))}
    pool.shutdown(wait=False)
    yield futures
    for future in futures.values():
        if future.exception() is None:
            future.result().stop()


@pytest.fixture(scope="module")
def server(launched, references):
    return launched["main"].result()


def _run_concurrently(server, cases):
    def one(index):
        status, body = server.chat(_body(*cases[index][1], _max_tokens(index)))
        assert status == 200, body
        return body

    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(one, range(len(cases))))


def test_parity_one_request_at_a_time(server, cases, references, tiny_qwen3_vl_dir):
    """In order, so the second turn finds the first turn's blocks in the prefix cache."""
    for index, (name, case) in enumerate(cases):
        status, body = server.chat(_body(*case, _max_tokens(index)))
        assert status == 200, body
        assert_chat_parity(body, references[name])
        body_sent = _body(*case, _max_tokens(index))
        status, raw = server.request("POST", "/tokenize", orjson.dumps({"messages": body_sent["messages"],
                                                                        **({"mm_processor_kwargs": case[2]} if case[2] else {})}))
        assert status == 200, raw
        assert orjson.loads(raw)["tokens"] == references[name]["prompt_token_ids"]
        if name == "second_turn":
            image_end = len(body["prompt_token_ids"]) - body["prompt_token_ids"][::-1].index(_image_token(tiny_qwen3_vl_dir))
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= image_end - 16


def _image_token(model_dir) -> int:
    return orjson.loads((model_dir / "config.json").read_bytes())["image_token_id"]


def test_parity_all_concurrently(server, cases, references):
    for (name, _), body in zip(cases, _run_concurrently(server, cases)):
        assert_chat_parity(body, references[name])


def test_parity_when_the_image_comes_from_the_encoder_cache(server, tiny_qwen3_vl_dir):
    """The same new image after different text: no prefix reaches it, so the second request
    computes every image row, with the encoder output (and its DeepStack rows) the first one
    left in the encoder cache."""
    image = {"type": "image", "media": random_image(30, 500, 400)}
    for text, follow_up in (("First look.", None), ("Then look again.", None)):
        body = _body([], text, {}, follow_up, 6)
        body["messages"][0]["content"].append({"type": "image_url", "image_url": {
            "url": image_data_url(image["media"])}})
        before = server.metrics()
        status, answer = server.chat(body)
        assert status == 200, answer
        forwards = server.metrics()["vlmd_encoder_forwards_total"] - before["vlmd_encoder_forwards_total"]
        messages = [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}]
        assert_chat_parity(answer, hf_qwen3_vl_generate(tiny_qwen3_vl_dir, messages, [image["media"]], 6))
    assert forwards == 0, "the second request should have found the encoder output"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] < answer["prompt_token_ids"].index(
        _image_token(tiny_qwen3_vl_dir))


def test_parity_tp2_items_split_across_steps_and_preempted(launched, cases, references):
    server = launched["split"].result()
    for _ in range(3):  # preemption needs the requests to overlap: at most three rounds
        steps_before = server.metrics()["vlmd_engine_steps_total"]
        bodies = _run_concurrently(server, cases)
        for (name, _), body in zip(cases, bodies):
            assert_chat_parity(body, references[name])
        metrics = server.metrics()
        prompt_tokens = sum(body["usage"]["prompt_tokens"] for body in bodies)
        assert metrics["vlmd_engine_steps_total"] - steps_before >= prompt_tokens // 16
        if metrics["vlmd_num_preemptions_total"] > 0:
            break
    assert metrics["vlmd_num_preemptions_total"] > 0, "the test meant to force preemption"


def test_parity_when_the_prefix_cache_ends_inside_the_image(launched, tiny_qwen3_vl_dir):
    """On the split server (14 blocks of 16): an image request, then a text request taking
    every block but two, which evicts the image request's blocks tail first (their order of
    eviction), then the image request again: its prefix hit ends inside the image, so the
    rest of the image's rows (and their DeepStack additions) come from its encoder output."""
    server = launched["split"].result()
    parts = [{"type": "image", "media": random_image(20, 640, 480)}]
    reference = _reference(tiny_qwen3_vl_dir, parts, "What is in this image?", {}, None, 3)
    status, first = server.chat(_body(parts, "What is in this image?", {}, None, 3))
    assert status == 200, first
    assert_chat_parity(first, reference)
    words = ["sea"] * 150
    while True:  # a text prompt that leaves two of the 14 blocks, whatever the tokenizer makes of it
        messages = [{"role": "user", "content": " ".join(words)}]
        status, raw = server.request("POST", "/tokenize", orjson.dumps({"messages": messages}))
        count = orjson.loads(raw)["count"]
        if count + 2 > 11 * 16:
            break
        words += ["sea"] * max(1, (11 * 16 + 1 - count - 2) // 2)
    assert count + 2 <= 12 * 16, count
    status, body = server.chat({"messages": messages, "max_tokens": 2, "ignore_eos": True})
    assert status == 200, body
    status, again = server.chat(_body(parts, "What is in this image?", {}, None, 3))
    assert status == 200, again
    assert_chat_parity(again, reference)
    image = [i for i, token in enumerate(again["prompt_token_ids"]) if token == _image_token(tiny_qwen3_vl_dir)]
    assert image[0] < again["usage"]["prompt_tokens_details"]["cached_tokens"] <= image[-1], (image, again["usage"])


def _image_request(*images: Image.Image) -> dict:
    content = [{"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in images]
    return {"messages": [{"role": "user", "content": content + [{"type": "text", "text": "hi"}]}], "max_tokens": 2}


def _video_request(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}],
            "max_tokens": 2}


def test_bad_input_is_a_400_and_the_server_still_serves(server):
    bomb = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(png_header_only(20000, 20000)).decode()}}]}]}
    cases = [
        (_image_request(Image.new("RGB", (1, 1))), "too small"),
        (bomb, "image is too large"),
        (_image_request(Image.new("RGB", (2, 1000))), "aspect ratio"),
        (_image_request(*(random_image(seed, 64, 64) for seed in range(3))), "at most 2 image"),
        ({**_image_request(random_image(1, 64, 64)), "mm_processor_kwargs": {"max_pixels": 10**7}},
         "exceeds this server's image limit"),
        (_video_request("data:video/mp4;base64,AAAA"), "video"),
        (_video_request(video_data_url(make_video(MAX_FRAMES + 4, 64, 64))), f"the limit is {MAX_FRAMES}"),
        (_video_request(video_data_url(make_video(1, 64, 64))), "at least 2 frames"),
        ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_data_url(
            make_video(2, 64, 64))}}] * 2}], "max_tokens": 2}, "at most 1 video"),
    ]
    for request, message in cases:
        status, body = server.chat(request)
        assert status == 400, body
        assert message in body["error"]["message"], body
        assert body["error"]["type"] == "invalid_request_error"
    status, body = server.chat(_image_request(random_image(7, 64, 64)))
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
