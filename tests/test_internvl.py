"""InternVL3 through the real server: greedy tokens equal transformers' generate.

The tiny checkpoint has 112-px tiles, at most 6 tiles (plus the thumbnail) and 16 tokens per
tile. Cases: one tile (no thumbnail), the most tiles (a 3x2 grid + thumbnail), a thin wide
strip and a thin tall one (6x1 and 1x6), two images of different grids (3x2 and 1x3), text
only and a per-request ``max_patches`` (a 6x1 strip cut 2x1). Each runs alone, then all
concurrently; a second turn over the first one's answer must find its prefix cached; a video
(one tile per frame under "FrameN:" labels) runs alone and beside an image. The shared
server's token budget (32) splits every image across steps; a second server adds
``--tensor-parallel-size 2``, a KV cache that forces preemption and a server-wide
``max_patches``. ``usage.prompt_tokens`` and ``/tokenize`` equal the length of transformers'
processor output. A first divergence is accepted only where transformers' own top-1/top-2
log-prob gap is < 1e-3, and the greedy tokens' log-probs agree within 1e-3 up to it.
"""

from __future__ import annotations

import base64
import re
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from conftest import Server, assert_refused_then_served, image_data_url, make_video, png_header_only, random_image, video_data_url
from internvl_support import hf_internvl_generate
from oracle import assert_chat_parity
from test_qwen2_vl import reference_frames

NUM_FRAMES = 4  # frames the servers keep of a video
SERVER_MAX_PATCHES = 4  # the TP server's --mm-processor-kwargs, under the checkpoint's 6

CASES = {  # name: ([(seed, width, height), ...], text, mm_processor_kwargs, tiles per image on the default server)
    "one_tile_100x90": ([(1, 100, 90)], "What is in this image?", {}, [1]),
    "most_tiles_640x430": ([(2, 640, 430)], "Describe it in detail.", {}, [7]),
    "strip_1900x57": ([(3, 1900, 57)], "Read the banner.", {}, [7]),
    "strip_57x1900": ([(4, 57, 1900)], "Describe the tall picture.", {}, [7]),
    "two_images": ([(5, 320, 240), (6, 96, 300)], "Compare them.", {}, [7, 4]),
    "text_only": ([], "Write a short poem about the sea.", {}, []),
    "max_patches_2": ([(7, 1500, 100)], "Describe it briefly.", {"max_patches": 2}, [3]),
}
CASE_NAMES = list(CASES)


def _max_tokens(index: int) -> int:
    return 8 + 3 * index


def _images(name):
    return [random_image(seed, width, height) for seed, width, height in CASES[name][0]]


def _body(name: str, max_tokens: int) -> dict:
    _, text, kwargs, _ = CASES[name]
    content = [{"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in _images(name)]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            "logprobs": True}
    if kwargs:
        body["mm_processor_kwargs"] = kwargs
    return body


def _reference(model_dir, name: str, max_tokens: int, server_kwargs: dict | None = None) -> dict:
    _, text, kwargs, _ = CASES[name]
    images = _images(name)
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return hf_internvl_generate(model_dir, [{"role": "user", "content": parts}], images, max_tokens,
                                {**(server_kwargs or {}), **kwargs})


@pytest.fixture(scope="module")
def references(tiny_internvl_dir):
    return {name: _reference(tiny_internvl_dir, name, _max_tokens(index)) for index, name in enumerate(CASE_NAMES)}


@pytest.fixture(scope="module")
def server(tiny_internvl_dir, tmp_path_factory):
    # A token budget of 32: every image's placeholders are split across steps (of one rank).
    server = Server(tiny_internvl_dir, "--limit-mm-per-prompt", "image=2,video=1", "--max-model-len", "2048",
                    "--max-num-batched-tokens", "32", "--media-io-kwargs",
                    orjson.dumps({"video": {"num_frames": NUM_FRAMES}}).decode(),
                    log_dir=tmp_path_factory.mktemp("internvl-logs"))
    yield server
    server.stop()


def _run_concurrently(server, names=CASE_NAMES):
    def one(name):
        status, body = server.chat(_body(name, _max_tokens(CASE_NAMES.index(name))))
        assert status == 200, body
        return body

    with ThreadPoolExecutor(len(names)) as pool:
        return list(pool.map(one, names))


def test_the_cases_cover_the_tiling_rules(references):
    for name, (_, _, _, tiles) in CASES.items():
        assert references[name]["num_tiles"] == sum(tiles), name


@pytest.mark.parametrize("name", CASE_NAMES)
def test_parity_one_request(server, references, name):
    steps_before = server.metrics()["vlmd_engine_steps_total"]
    status, body = server.chat(_body(name, _max_tokens(CASE_NAMES.index(name))))
    assert status == 200, body
    assert_chat_parity(body, references[name])
    # The prompt took a step per 32 tokens at least: its images were split across steps.
    assert server.metrics()["vlmd_engine_steps_total"] - steps_before >= body["usage"]["prompt_tokens"] // 32
    assert body["usage"]["prompt_tokens_details"].get("multimodal_tokens", {}).get("image", 0) == \
        16 * sum(CASES[name][3])


@pytest.mark.parametrize("name", ["most_tiles_640x430", "two_images", "max_patches_2"])
def test_tokenize_counts_equal_the_processors(server, references, name):
    body = _body(name, 1)
    request = {"model": server.model, "messages": body["messages"], **({"mm_processor_kwargs": body["mm_processor_kwargs"]}
                                                                       if "mm_processor_kwargs" in body else {})}
    status, raw = server.request("POST", "/tokenize", orjson.dumps(request))
    tokens = orjson.loads(raw)
    assert status == 200, tokens
    assert tokens["tokens"] == references[name]["prompt_token_ids"]
    assert tokens["count"] == len(references[name]["prompt_token_ids"])


def test_parity_all_concurrently(server, references):
    for name, body in zip(CASE_NAMES, _run_concurrently(server)):
        assert_chat_parity(body, references[name])


def test_second_turn_finds_the_first_cached(server, references, tiny_internvl_dir):
    name = "two_images"
    first = references[name]
    _, text, _, _ = CASES[name]
    parts = [{"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in _images(name)]
    answer = server.chat(_body(name, _max_tokens(CASE_NAMES.index(name))))[1]["choices"][0]["message"]["content"]
    history = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]},
               {"role": "assistant", "content": answer}]
    status, body = server.chat({"messages": [*history, {"role": "user", "content": "And the colours?"}],
                                "max_tokens": 10, "temperature": 0, "return_token_ids": True, "logprobs": True})
    assert status == 200, body
    ref_history = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": text}]},
                   {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                   {"role": "user", "content": [{"type": "text", "text": "And the colours?"}]}]
    ref = hf_internvl_generate(tiny_internvl_dir, ref_history, _images(name), 10)
    assert_chat_parity(body, ref)
    # The first turn's prompt (both images' placeholders) is in the cache, whole blocks of it.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(first["prompt_token_ids"]) // 16 * 16


def test_parity_tp2_split_across_steps_and_preempted(tiny_internvl_dir, tmp_path):
    """One start covers the hard regimes, as the other families' TP tests do (rank processes
    cost seconds to start): two ranks, a token budget that splits images across steps, a KV
    cache that preempts, server-wide ``max_patches`` under the checkpoint's."""
    server = Server(tiny_internvl_dir, "--tensor-parallel-size", "2", "--torch-threads", "1",
                    "--limit-mm-per-prompt", "image=2,video=0", "--max-num-batched-tokens", "32",
                    "--num-kv-blocks", "20", "--max-model-len", "320",
                    "--mm-processor-kwargs", orjson.dumps({"max_patches": SERVER_MAX_PATCHES}).decode(),
                    log_dir=tmp_path)
    try:
        refs = [_reference(tiny_internvl_dir, name, _max_tokens(index), {"max_patches": SERVER_MAX_PATCHES})
                for index, name in enumerate(CASE_NAMES)]
        # Preemption needs the requests to overlap, which depends on when each one's
        # preprocessing ends on a loaded host: every round is checked, at most three are sent.
        for _ in range(3):
            steps_before = server.metrics()["vlmd_engine_steps_total"]
            bodies = _run_concurrently(server)
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
    parts = [{"type": "image_url", "image_url": {"url": url}}] * count
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}],
            "max_tokens": 2, **extra}


def test_video_parity(server, tiny_internvl_dir):
    """A video alone and beside an image, concurrently: one tile per kept frame, each under
    its "FrameN:" label, as transformers' processor writes them."""
    data = make_video(8, seed=3)
    frames = reference_frames(data, NUM_FRAMES)
    image = random_image(11, 300, 200)
    video_part = {"type": "video_url", "video_url": {"url": video_data_url(data)}}
    image_part = {"type": "image_url", "image_url": {"url": image_data_url(image)}}
    cases = [([video_part], [{"type": "video"}], []), ([video_part, image_part], [{"type": "video"}, {"type": "image"}],
                                                       [image])]

    def one(case):
        parts, _, _ = case
        return server.chat({"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}],
                            "max_tokens": 12, "temperature": 0, "return_token_ids": True, "logprobs": True})

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(one, cases))
    for (_, ref_parts, images), (status, body) in zip(cases, answers):
        assert status == 200, body
        messages = [{"role": "user", "content": [*ref_parts, {"type": "text", "text": "What happens?"}]}]
        ref = hf_internvl_generate(tiny_internvl_dir, messages, images, 12, videos=[frames])
        assert_chat_parity(body, ref)
        assert ref["num_tiles"] == NUM_FRAMES + (7 if images else 0)  # the image: 3x2 + thumbnail


def test_structured_output_with_an_image(server):
    """Constraints work on this family as on the others: the grammar masks its logits."""
    url = image_data_url(random_image(12, 640, 430))
    status, body = server.chat(_image_request(url, structured_outputs={"choice": ["red", "green", "blue"]},
                                              max_tokens=8, temperature=0))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] in {"red", "green", "blue"}
    status, body = server.chat(_image_request(url, structured_outputs={"regex": r"[0-9]{3}"}, max_tokens=8))
    assert status == 200, body
    assert re.fullmatch(r"[0-9]{3}", body["choices"][0]["message"]["content"]), body


def _png_url(width: int, height: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_header_only(width, height)).decode()


@pytest.mark.parametrize(
    ("request_body", "message"),
    [
        (lambda: _image_request(image_data_url(random_image(1, 1, 1))), "too small"),
        (lambda: _image_request(_png_url(100_000, 100_000)), "image is too large"),
        (lambda: _image_request(image_data_url(random_image(1, 64, 64)), count=3), "at most 2 image"),
        (lambda: _image_request(image_data_url(random_image(1, 64, 64)), mm_processor_kwargs={"max_patches": 7}),
         "exceeds this server's limit of 6 tiles"),
        (lambda: _image_request(image_data_url(random_image(1, 64, 64)), mm_processor_kwargs={"max_patches": 0}),
         "positive integer"),
        (lambda: _image_request(image_data_url(random_image(1, 64, 64)),
                                mm_processor_kwargs={"min_patches": 4, "max_patches": 2}), "larger than max_patches"),
        (lambda: _image_request(image_data_url(random_image(1, 64, 64)), mm_processor_kwargs={"max_pixels": 4}),
         "unknown mm_processor_kwargs"),
    ],
    ids=["1x1", "huge", "too-many-items", "max-patches-over-server", "max-patches-zero", "min-over-max",
         "unknown-kwarg"],
)
def test_bad_input_is_a_4xx_and_a_good_request_follows(server, request_body, message):
    good = _image_request(image_data_url(random_image(2, 200, 100)), mm_processor_kwargs={"max_dynamic_patch": 3})
    body = assert_refused_then_served(server, request_body(), message, good)
    assert body["usage"]["prompt_tokens_details"]["multimodal_tokens"]["image"] == 16 * 3  # 2x1 + thumbnail
