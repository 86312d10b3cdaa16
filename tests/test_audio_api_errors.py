"""Bad uploads to /v1/audio/*: a clear OpenAI-shaped 4xx each, and the server keeps serving.

The shared tiny Whisper server runs with a 3,000,000-byte upload bound and a 100 s duration
bound (--media-io-kwargs), so the bounds are reached with small files.
"""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from whisper_support import multipart, post_audio, wav_bytes

GOOD = wav_bytes(np.zeros(16000, np.float32))


def _error(status: int, body: bytes) -> dict:
    error = orjson.loads(body)["error"]
    assert error["code"] in (status, "model_not_found") and error["message"] and error["type"]
    return error


@pytest.mark.parametrize(
    "file, status, fragment",
    [
        (b"this is a text file, not audio" * 20, 400, "not a supported format"),
        (b"", 400, "empty"),
        (b"ID3" + bytes(500), 400, "cannot decode"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00" + bytes(30), 400, "cannot decode"),
        (bytes(3_000_001), 413, "larger than the limit of 3000000 bytes"),
        (wav_bytes(np.zeros(8000 * 101, np.float32), rate=8000), 400, "longer than the limit of 100 seconds"),
        (wav_bytes(np.zeros(0, np.float32)), 400, "no samples"),
    ],
    ids=["not-audio", "empty", "corrupt-mp3", "truncated-wav", "over-size", "over-duration", "no-samples"],
)
def test_bad_audio_is_a_clear_4xx(whisper_server, file, status, fragment):
    got, body = post_audio(whisper_server, {}, file)
    assert got == status, body
    assert fragment in _error(status, body)["message"]


@pytest.mark.parametrize(
    "fields, status, param",
    [
        ({"response_format": "mp3"}, 400, "response_format"),
        ({"temperature": "2"}, 400, "temperature"),
        ({"temperature": "warm"}, 400, "temperature"),
        ({"stream": "true", "response_format": "srt"}, 400, "stream"),
        ({"stream": "maybe"}, 400, "stream"),
        ({"timestamp_granularities[]": "char", "response_format": "verbose_json"}, 400, "timestamp_granularities"),
        ({"language": "xx"}, 400, "language"),
        ({"model": "no-such-model"}, 404, "model"),
        ({"model": ""}, 400, "model"),
    ],
)
def test_bad_fields_are_a_clear_4xx(whisper_server, fields, status, param):
    got, body = post_audio(whisper_server, fields, GOOD)
    assert got == status, body
    assert _error(status, body)["param"] == param


def test_malformed_requests(whisper_server):
    status, body = post_audio(whisper_server, {}, None)
    assert status == 400 and _error(400, body)["param"] == "file"
    status, body = whisper_server.request("POST", "/v1/audio/transcriptions", orjson.dumps({"model": "x"}))
    assert status == 400 and "multipart/form-data" in _error(400, body)["message"]
    payload, content_type = multipart({"model": whisper_server.model}, GOOD)
    boundary = content_type.split("boundary=")[1]
    second = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="b.wav"\r\n\r\n'.encode()
    doubled = payload.replace(f"--{boundary}--".encode(), second + GOOD + f"\r\n--{boundary}--".encode())
    status, body = whisper_server.request("POST", "/v1/audio/transcriptions", doubled,
                                          headers={"Content-Type": content_type})
    assert status == 400 and "exactly one" in _error(400, body)["message"]
    status, body = whisper_server.request("GET", "/v1/audio/transcriptions")
    assert status == 405


def test_a_bare_prompt_is_refused_since_every_whisper_prompt_needs_its_audio(whisper_server):
    """Its processing info says prompts need an item (``accepts_text_only_prompts``)."""
    for prompt in ([1, 2], "hello"):
        status, body = whisper_server.request(
            "POST", "/v1/completions", orjson.dumps({"model": whisper_server.model, "prompt": prompt, "max_tokens": 1}))
        assert status == 400 and "/v1/audio/transcriptions" in _error(400, body)["message"], body


def test_the_server_still_transcribes_after_bad_requests(whisper_server):
    status, body = post_audio(whisper_server, {"language": "en"}, GOOD)
    assert status == 200 and "text" in orjson.loads(body)


def test_a_model_without_audio_says_so(llava_server):
    status, body = post_audio(llava_server, {}, GOOD)
    assert status == 400 and "does not take audio" in _error(400, body)["message"]
