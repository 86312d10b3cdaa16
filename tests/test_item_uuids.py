"""Media by reference: vLLM's ``uuid`` on a content part. An item sent once with its bytes
and a uuid may be sent again as the uuid alone; the answer is the one its bytes give, and
the caches serve it (no fetch, no decode, no processing, no encoder run). An unknown uuid
without bytes, or a malformed one, is a 400 that says so."""

from __future__ import annotations

import pytest

from conftest import assert_error, image_data_url, random_image
from qwen2_audio_support import encode, input_audio, make_clip, text


def _chat(server, *parts, max_tokens: int = 8) -> tuple[int, dict]:
    return server.chat({"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe it."}]}],
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True})


def _image_part(image, uuid: str | None = None) -> dict:
    part = {"type": "image_url", "image_url": {"url": image_data_url(image)}}
    return part if uuid is None else {**part, "uuid": uuid}


def _tokens(status: int, body: dict) -> list[int]:
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def _delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.mark.parametrize("by_uuid", [
    {"type": "image_url", "uuid": "sku-1234-a"},
    {"type": "image_url", "image_url": None, "uuid": "sku-1234-a"},
    {"type": "image_url", "image_url": {"url": None}, "uuid": "sku-1234-a"},
], ids=["no-key", "null", "null-url"])
def test_a_uuid_alone_gets_the_tokens_its_bytes_got_from_the_caches(llava_server, by_uuid):
    image = random_image(61, 320, 240)
    with_bytes = _tokens(*_chat(llava_server, _image_part(image, "sku-1234-a")))
    assert with_bytes == _tokens(*_chat(llava_server, _image_part(image)))  # the uuid changes no answer
    before = llava_server.metrics()
    status, body = _chat(llava_server, by_uuid)
    after = llava_server.metrics()
    assert _tokens(status, body) == with_bytes
    assert body["usage"]["prompt_tokens_details"]["image_tokens"] == 576
    # Served from the caches: nothing fetched or decoded, the processed item and the encoder
    # output found, the image's KV blocks found in the prefix cache.
    assert _delta(before, after, 'vlmd_media_fetch_seconds_count{modality="image"}') == 0
    assert _delta(before, after, "vlmd_decoded_image_queries_total") == 0
    assert _delta(before, after, "vlmd_processor_cache_hits_total") == 1
    assert _delta(before, after, 'vlmd_media_preprocess_seconds_count{modality="image"}') == 0
    assert _delta(before, after, "vlmd_encoder_forwards_total") == 0
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 576


def test_a_uuid_sent_with_other_bytes_names_those_bytes_from_then_on(llava_server):
    first, second = random_image(62, 96, 96), random_image(63, 96, 96)
    _tokens(*_chat(llava_server, _image_part(first, "moving-uuid")))
    second_tokens = _tokens(*_chat(llava_server, _image_part(second, "moving-uuid")))
    assert second_tokens != _tokens(*_chat(llava_server, _image_part(first)))  # the two images answer apart
    assert _tokens(*_chat(llava_server, {"type": "image_url", "uuid": "moving-uuid"})) == second_tokens


def test_a_uuid_registered_earlier_in_the_same_request_serves_a_later_part(llava_server):
    image = random_image(64, 64, 64)
    both = _chat(llava_server, _image_part(image, "same-request"), {"type": "image_url", "uuid": "same-request"})
    twice = _chat(llava_server, _image_part(image), _image_part(image))
    assert _tokens(*both) == _tokens(*twice)


def test_an_unknown_uuid_without_bytes_is_a_400_that_names_it(llava_server):
    status, body = _chat(llava_server, {"type": "image_url", "uuid": "never-sent-1"})
    assert_error(status, body, 400, "uuid 'never-sent-1'", "not known", "send the item's data or URL")
    # A uuid of another modality is another item: an image's uuid does not name a video.
    _tokens(*_chat(llava_server, _image_part(random_image(65, 64, 64), "image-only")))
    status, body = llava_server.chat({"messages": [{"role": "user", "content": [
        {"type": "video_url", "uuid": "image-only"}, {"type": "text", "text": "hi"}]}], "max_tokens": 2})
    assert status == 400, body  # this model takes no video at all; the uuid does not change that


@pytest.mark.parametrize("uuid", [7, "", "x" * 257, ["a"]], ids=["number", "empty", "too-long", "list"])
def test_a_malformed_uuid_is_a_400(llava_server, uuid):
    status, body = _chat(llava_server, {"type": "image_url", "image_url": {"url": image_data_url(random_image(66, 32, 32))},
                                        "uuid": uuid})
    assert_error(status, body, 400, "uuid must be a string of 1 to 256 characters")


def test_an_input_audio_clip_by_uuid(qwen2_audio_server):
    clip = input_audio(encode(make_clip(1.5, 31), "WAV"), "wav")
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    status, first = qwen2_audio_server.chat({**body, "messages": [{"role": "user", "content": [
        {**clip, "uuid": "clip-31"}, text("What is it?")]}]})
    assert status == 200, first
    before = qwen2_audio_server.metrics()
    status, again = qwen2_audio_server.chat({**body, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": None, "uuid": "clip-31"}, text("What is it?")]}]})
    after = qwen2_audio_server.metrics()
    assert status == 200, again
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert _delta(before, after, 'vlmd_media_fetch_seconds_count{modality="audio"}') == 0
    assert _delta(before, after, "vlmd_encoder_forwards_total") == 0
