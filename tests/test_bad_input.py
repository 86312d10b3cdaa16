"""Bad input end to end over HTTP: every case gets a clear OpenAI-shaped 4xx, and the server
keeps serving good image requests afterwards.

All cases share the session ``llava_server`` (--limit-mm-per-prompt image=3,
--max-model-len 2048, --allowed-local-media-path <media_dir>, no private media URLs).
"""

from __future__ import annotations

import base64
import io
import re
import time
import urllib.error
import urllib.request

import orjson
import pytest
from PIL import Image

from conftest import assert_error, image_data_url, image_message, png_header_only, random_image

MAX_MODEL_LEN = 2048


# --- helpers -----------------------------------------------------------------------------


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def url_message(text: str, *urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


GOOD_IMAGE = random_image(7, 96, 64)


def assert_serves_good_image(server) -> None:
    status, body = server.chat({"messages": image_message("What is in this image?", GOOD_IMAGE), "max_tokens": 4})
    assert status == 200, body
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 1
    assert body["usage"]["prompt_tokens"] > 576  # the image's placeholders are in the prompt


@pytest.fixture
def server(llava_server):
    """The shared server; after each case it must still answer a good image request."""
    yield llava_server
    assert llava_server.process.poll() is None, "the server died"
    assert_serves_good_image(llava_server)


def post_raw(server, body: bytes, path: str = "/v1/chat/completions"):
    return server.request("POST", path, body)


# --- the body itself ---------------------------------------------------------------------


def test_malformed_json(server):
    status, raw = post_raw(server, b'{"model": "tiny", "messages": [')
    assert_error(status, raw, 400, "not valid json")


def test_empty_body(server):
    status, raw = post_raw(server, b"")
    assert_error(status, raw, 400, "not valid json")


def test_body_is_a_json_array(server):
    status, raw = post_raw(server, orjson.dumps([{"model": server.model, "messages": []}]))
    assert_error(status, raw, 400, "must be a json object")


def test_missing_messages(server):
    status, raw = post_raw(server, orjson.dumps({"model": server.model}))
    assert_error(status, raw, 400, "messages", "required", param="messages")


def test_missing_model(server):
    status, raw = post_raw(server, orjson.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    assert_error(status, raw, 400, "model", "required", param="model")


@pytest.mark.parametrize("messages", [[], "hello", [{"role": "user"}], [{"role": "robot", "content": "hi"}], [42]])
def test_invalid_messages(server, messages):
    status, body = server.chat({"messages": messages, "max_tokens": 2})
    assert_error(status, body, 400, "messages", param="messages")


def test_wrong_field_type(server):
    status, body = server.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"})
    assert_error(status, body, 400, "max_tokens", "type", param="max_tokens")


def test_unknown_model(server):
    status, raw = post_raw(server, orjson.dumps({"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}))
    error = assert_error(status, raw, 404, "gpt-17", "does not exist", param="model")
    assert error["type"] == "not_found_error"
    assert error["code"] == "model_not_found"


def test_unknown_route(server):
    status, raw = server.request("POST", "/v1/not-a-route", b"{}")
    error = assert_error(status, raw, 404, "/v1/not-a-route")
    assert error["type"] == "not_found_error"
    status, raw = server.request("GET", "/nothing/here")
    assert_error(status, raw, 404, "/nothing/here")


def test_wrong_method(server):
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.url + "/v1/chat/completions", timeout=30)
    assert "POST" in info.value.headers.get("Allow", "")
    assert_error(info.value.code, info.value.read(), 405, "GET", "/v1/chat/completions", "POST")


# --- media that cannot be used -----------------------------------------------------------


def test_bad_base64(server):
    status, body = server.chat({"messages": url_message("hi", "data:image/png;base64,@@@not*base64@@@")})
    assert_error(status, body, 400, "invalid base64")


def test_data_url_not_base64(server):
    status, body = server.chat({"messages": url_message("hi", "data:image/png,rawbytes")})
    assert_error(status, body, 400, "base64")


def test_bytes_that_are_not_an_image(server):
    status, body = server.chat({"messages": url_message("hi", data_url(b"%PDF-1.4 definitely not pixels" * 10))})
    assert_error(status, body, 400, "cannot identify image")


def test_truncated_jpeg(server):
    buffer = io.BytesIO()
    random_image(3, 256, 256).save(buffer, "JPEG", quality=90)
    data = buffer.getvalue()
    status, body = server.chat({"messages": url_message("hi", data_url(data[: len(data) // 2], "image/jpeg"))})
    assert_error(status, body, 400, "cannot decode jpeg", "truncated")


def test_one_pixel_image(server):
    status, body = server.chat({"messages": url_message("hi", data_url(png_bytes(Image.new("RGB", (1, 1)))))})
    assert_error(status, body, 400, "too small", "1x1")


def test_decompression_bomb_header(server):
    bomb = png_header_only(20000, 20000)
    assert len(bomb) < 100
    status, body = server.chat({"messages": url_message("hi", data_url(bomb))})
    assert_error(status, body, 400, "image is too large", "pixels")


def test_extreme_aspect_ratio_is_refused_before_resizing(server):
    """A 2x20000 PNG is a few hundred bytes and 40k pixels, but scaling its short side to
    336 would make a 336x3360000 image (gigabytes, tens of seconds)."""
    sliver = png_bytes(Image.new("RGB", (2, 20000), (200, 10, 10)))
    assert len(sliver) < 1000
    started = time.monotonic()
    status, body = server.chat({"messages": url_message("hi", data_url(sliver)), "max_tokens": 2})
    assert_error(status, body, 400, "aspect ratio", "2x20000", "200:1")
    assert time.monotonic() - started < 5


def test_empty_image_url(server):
    message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]
    status, body = server.chat({"messages": message})
    assert_error(status, body, 400, "url", "non-empty", param="messages")


def test_unsupported_url_scheme(server):
    status, body = server.chat({"messages": url_message("hi", "ftp://example.com/x.png")})
    assert_error(status, body, 400, "unsupported media url", "ftp")


def test_bad_image_in_streaming_request_is_a_plain_400(server):
    """Preprocessing fails before the stream starts: a JSON 400, not an SSE body."""
    body = {"model": server.model, "messages": url_message("hi", data_url(b"junk")), "stream": True}
    status, raw = post_raw(server, orjson.dumps(body))
    assert_error(status, raw, 400, "cannot identify image")


# --- counts and placeholders -------------------------------------------------------------


def test_too_many_images(server):
    images = [random_image(i, 32, 32) for i in range(4)]
    status, body = server.chat({"messages": image_message("hi", *images), "max_tokens": 2})
    assert_error(status, body, 400, "at most 3 image", "got 4")


def test_image_marker_typed_in_text_without_image(server):
    status, body = server.chat({"messages": [{"role": "user", "content": "look: <image> what is it?"}]})
    assert_error(status, body, 400, "1 image placeholder", "0 image item", "marker")


def test_image_marker_typed_in_text_with_one_image(server):
    status, body = server.chat({"messages": image_message("and <image> here", GOOD_IMAGE), "max_tokens": 2})
    assert_error(status, body, 400, "2 image placeholder", "1 image item")


# --- lengths -----------------------------------------------------------------------------


def _count_prompt_tokens(tokenizer_dir, messages) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_prompt_longer_than_max_model_len(server, tiny_llava_dir):
    text = " ".join(f"word{i}" for i in range(3000))
    messages = [{"role": "user", "content": text}]
    expected = _count_prompt_tokens(tiny_llava_dir, messages)
    assert expected > MAX_MODEL_LEN
    status, body = server.chat({"messages": messages, "max_tokens": 4})
    error = assert_error(status, body, 400, str(expected), str(MAX_MODEL_LEN))
    assert "max_model_len" in error["message"]


def test_huge_max_tokens_names_the_real_context_length(server):
    status, body = server.chat({"messages": image_message("hi", GOOD_IMAGE), "max_tokens": 2**63 - 1})
    error = assert_error(status, body, 400, str(MAX_MODEL_LEN), str(2**63 - 1), param="max_tokens")
    assert str(2**31) not in error["message"]


def test_max_tokens_does_not_fit(server):
    status, body = server.chat({"messages": image_message("hi", GOOD_IMAGE), "max_tokens": 2000})
    error = assert_error(status, body, 400, str(MAX_MODEL_LEN), "2000", param="max_tokens")
    numbers = [int(n) for n in re.findall(r"\d+", error["message"])]
    assert any(576 < n < MAX_MODEL_LEN for n in numbers), error  # the prompt's token count


# --- local files and private URLs --------------------------------------------------------


def test_file_url_outside_allowed_path(server):
    status, body = server.chat({"messages": url_message("hi", "file:///etc/passwd")})
    assert_error(status, body, 400, "outside --allowed-local-media-path")


def test_file_url_dotdot_escape(server, media_dir):
    url = f"file://{media_dir}/../../../../../../etc/passwd"
    status, body = server.chat({"messages": url_message("hi", url)})
    assert_error(status, body, 400, "outside --allowed-local-media-path")
    encoded = f"file://{media_dir}/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd"
    status, body = server.chat({"messages": url_message("hi", encoded)})
    assert_error(status, body, 400, "outside --allowed-local-media-path")


def test_file_url_symlink_escape(server, media_dir):
    link = media_dir / "escape.png"
    link.symlink_to("/etc/passwd")
    try:
        status, body = server.chat({"messages": url_message("hi", f"file://{link}")})
    finally:
        link.unlink()
    assert_error(status, body, 400, "outside --allowed-local-media-path")


def test_file_url_missing_file(server, media_dir):
    status, body = server.chat({"messages": url_message("hi", f"file://{media_dir}/no-such.png")})
    assert_error(status, body, 400, "file not found")


def test_file_url_inside_allowed_path_works(llava_server, media_dir):
    path = media_dir / "inside.png"
    GOOD_IMAGE.save(path, "PNG")
    status, body = llava_server.chat(
        {"messages": url_message("What is this?", f"file://{path}"), "max_tokens": 4, "temperature": 0}
    )
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > 576
    # Same pixels by data URL: same prompt, same greedy completion.
    status, same = llava_server.chat(
        {"messages": url_message("What is this?", image_data_url(GOOD_IMAGE)), "max_tokens": 4, "temperature": 0}
    )
    assert status == 200, same
    assert same["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert same["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]


def test_private_http_url_refused(server):
    # The server's own port: something really listens there, so only the policy can refuse it.
    url = f"http://127.0.0.1:{server.port}/x.png"
    status, body = server.chat({"messages": url_message("hi", url)})
    assert_error(status, body, 400, "refusing to fetch", "127.0.0.1", "loopback")
    status, body = server.chat({"messages": url_message("hi", f"http://localhost:{server.port}/x.png")})
    assert_error(status, body, 400, "refusing to fetch", "localhost")


# --- content parts -----------------------------------------------------------------------


def test_unsupported_content_part_type(server):
    messages = [{"role": "user", "content": [{"type": "hologram", "hologram": {}}, {"type": "text", "text": "hi"}]}]
    status, body = server.chat({"messages": messages})
    assert_error(status, body, 400, "'hologram'", "not supported", "messages[0].content[0]", param="messages")


def test_video_part_refused(server):
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
        {"type": "text", "text": "what happens?"},
    ]}]
    status, body = server.chat({"messages": messages})
    assert_error(status, body, 400, "does not accept video", param="messages")


def test_text_part_without_text(server):
    messages = [{"role": "user", "content": [{"type": "text", "text": 5}]}]
    status, body = server.chat({"messages": messages})
    assert_error(status, body, 400, "text must be a string", param="messages")


# --- sampling parameters -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param", "fragments"),
    [
        ({"temperature": -1}, "temperature", ("temperature", "non-negative")),
        ({"top_p": 0}, "top_p", ("top_p", "(0, 1]")),
        ({"top_p": 1.5}, "top_p", ("top_p", "(0, 1]")),
        ({"n": 0}, "n", ("between 1 and 16",)),
        ({"n": 17}, "n", ("between 1 and 16",)),
        ({"top_logprobs": 3}, "top_logprobs", ("top_logprobs", "logprobs")),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", ("top_logprobs", "20")),
        ({"top_k": -2}, "top_k", ("top_k",)),
        ({"max_tokens": 0}, "max_tokens", ("max_tokens", "at least 1")),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens", ("min_tokens",)),
        ({"stop": ["ok", ""]}, "stop", ("stop",)),
        ({"stop_token_ids": [-5]}, "stop_token_ids", ("stop_token_ids", "non-negative")),
    ],
)
def test_bad_sampling_parameters(server, extra, param, fragments):
    status, body = server.chat({"messages": image_message("hi", GOOD_IMAGE), **extra})
    assert_error(status, body, 400, *fragments, param=param)


@pytest.mark.parametrize("extra", [{"min_tokens": 2}, {}])
def test_stop_token_ids_outside_the_vocabulary(server, tiny_llava_dir, extra):
    """Used to reach the sampler, which indexed its logits with them: an IndexError that
    failed every request in the batch with a 500."""
    vocab_size = orjson.loads((tiny_llava_dir / "config.json").read_bytes())["text_config"]["vocab_size"]
    for bad in (vocab_size, 10**9):
        status, body = server.chat(
            {"messages": image_message("hi", GOOD_IMAGE), "stop_token_ids": [2, bad], "max_tokens": 4, **extra}
        )
        assert_error(status, body, 400, f"vocabulary size {vocab_size}", str(bad), param="stop_token_ids")
    status, body = server.chat(
        {"messages": image_message("hi", GOOD_IMAGE), "stop_token_ids": [vocab_size - 1], "max_tokens": 4, **extra}
    )
    assert status == 200, body


# --- the official client -----------------------------------------------------------------


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=url_message("hi", "file:///etc/passwd"))
    assert info.value.status_code == 400
    assert "outside --allowed-local-media-path" in info.value.message

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])

    messages = image_message("Describe the image.", GOOD_IMAGE)
    completion = client.chat.completions.create(model=server.model, messages=messages, max_tokens=5, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert isinstance(completion.choices[0].message.content, str)
    assert completion.usage.prompt_tokens > 576

    stream = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == completion.choices[0].finish_reason
    assert "".join(text) == completion.choices[0].message.content
    assert usage is not None and usage.prompt_tokens == completion.usage.prompt_tokens
