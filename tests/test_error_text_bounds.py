"""A huge value in a request is neither echoed in the error nor logged whole (issue 50,
item 2): every route names a refused field by its type and size, and the log keeps at most
``LOGGED_DETAIL_CHARACTERS`` of any error's text. Each case sends megabytes (or, where a
field's own bound is smaller, past that bound); the answer stays under 2 KiB without the
value's marker, and the server's log grows by under 4 KiB.
"""

from __future__ import annotations

import orjson
import pytest
from conftest import assert_error
from whisper_support import post_audio

MARKER = "HUGEVALUEMARKER"
HUGE_LIST = [MARKER + "x" * 1000] * 5000  # ~5 MB of short strings: the body scanner passes it
LONG_NAME = MARKER + "k" * 100_000  # a field name or model name of 100,000 characters
TEXT = [{"role": "user", "content": "hi"}]

CASES = {
    # case: (server fixture, path, body, status, fragments the message holds, param)
    "chat-no-op-field": ("llava_server", "/v1/chat/completions",
                         {"model": "tiny", "messages": TEXT, "service_tier": HUGE_LIST}, 400,
                         ("'service_tier' is not supported with a list of 5000 items",), "service_tier"),
    "chat-field-name": ("llava_server", "/v1/chat/completions", {"model": "tiny", "messages": TEXT, LONG_NAME: 1},
                        400, ("unrecognized request field a string of 100015 characters",), None),
    "chat-model": ("llava_server", "/v1/chat/completions", {"model": LONG_NAME, "messages": TEXT}, 404,
                   ("the model a string of 100015 characters does not exist",), "model"),
    "completions": ("llava_server", "/v1/completions", {"model": "tiny", "prompt": "hi", "store": HUGE_LIST}, 400,
                    ("'store' is not supported with a list of 5000 items",), "store"),
    "responses-tools": ("llava_server", "/v1/responses", {"model": "tiny", "input": "hi", "tools": HUGE_LIST}, 400,
                        ("'tools' is not supported with a list of 5000 items", "no tool calling"), "tools"),
    "responses-input-type": ("llava_server", "/v1/responses",
                             {"model": "tiny", "input": [{"type": HUGE_LIST, "content": "hi"}]}, 400,
                             ("input[0].type a list of 5000 items is not supported",), "input"),
    "tokenize": ("llava_server", "/tokenize", {"model": "tiny", "prompt": "hi", LONG_NAME: HUGE_LIST}, 400,
                 ("unrecognized request field a string of 100015 characters",), None),
    "detokenize": ("llava_server", "/detokenize", {"model": LONG_NAME, "tokens": [1]}, 404,
                   ("a string of 100015 characters",), "model"),
    "encoder-route": ("llava_encoder_server", "/v1/encoder_outputs", {"model": "tiny", "items": [], LONG_NAME: 1},
                      400, ("unrecognized request field a string of 100015 characters",), None),
}


def _bounded(server, send) -> tuple[int, bytes]:
    """``send()``'s answer, checked for the marker and its size, and the log's growth."""
    before = server.log_path.stat().st_size
    status, raw = send()
    assert len(raw) < 2048, raw[:300]
    assert MARKER.encode() not in raw
    # The handler has answered: its log line, if any, was written before the answer.
    assert server.log_path.stat().st_size - before < 4096
    return status, raw


@pytest.mark.parametrize("case", list(CASES))
def test_a_huge_value_is_named_by_type_and_size_never_echoed_or_logged_whole(request, case):
    fixture, path, body, expected, fragments, param = CASES[case]
    server = request.getfixturevalue(fixture)
    data = orjson.dumps(body)
    status, raw = _bounded(server, lambda: server.request("POST", path, data))
    assert_error(status, raw, expected, *fragments, param=param)


def test_a_huge_transcription_field_is_refused_by_size(whisper_server):
    language = MARKER + "e" * 60_000  # under the 64 KiB field bound, far past any language name
    status, raw = _bounded(whisper_server, lambda: post_audio(whisper_server, {"language": language}, b"RIFF"))
    assert_error(status, raw, 400, "a string of 60015 characters", param="language")


def test_the_logged_detail_is_capped():
    from vlmd.server.app import LOGGED_DETAIL_CHARACTERS, logged_detail

    assert logged_detail("short") == "short"
    text = "x" * (LOGGED_DETAIL_CHARACTERS + 1)
    assert logged_detail(text) == "x" * LOGGED_DETAIL_CHARACTERS + "\u2026 (2001 characters in all)"
