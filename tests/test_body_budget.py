"""Stalled uploads cannot hold the body budget hostage (issue 50, item 1; D97).

A client that declares a body and sends nothing costs its own connection and read deadline,
never another client's request: a declared length past the route's bound is a 413 at once
(nothing reserved, nothing read), and a declared length within it takes no share of the
bodies-in-flight budget until its bytes arrive. On the three routes that read large bodies:
chat (JSON), transcriptions (multipart) and the encoder route (JSON, ``--encoder-only``).
"""

from __future__ import annotations

import socket
from contextlib import ExitStack

import numpy as np
import orjson
import pytest
from conftest import Server, assert_error, image_data_url, random_image
from whisper_support import post_audio, wav_bytes

GIGABYTE = 2**30
STALLED = 4  # as many as the old reservation needed to fill 4 x --max-request-bytes


def _good_chat(server: Server) -> int:
    status, body = server.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200, body
    return status


def _good_transcription(server: Server) -> int:
    t = np.arange(16000) / 16000
    status, body = post_audio(server, {}, wav_bytes((0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)))
    assert status == 200, body
    return status


def _good_encoding(server: Server) -> int:
    part = {"type": "image_url", "image_url": {"url": image_data_url(random_image(3, 64, 64))}}
    status, body = server.request("POST", "/v1/encoder_outputs", orjson.dumps({"model": server.model, "items": [part]}))
    assert status == 200, body[:300]
    return status


ROUTES = {
    # route: (server fixture, path, content type, a length within its bound, a good request)
    "chat": ("llava_server", "/v1/chat/completions", "application/json", 64 * 2**20, _good_chat),
    "transcriptions": ("whisper_server", "/v1/audio/transcriptions", "multipart/form-data; boundary=b", 3_000_000,
                       _good_transcription),
    "encoder": ("llava_encoder_server", "/v1/encoder_outputs", "application/json", 64 * 2**20, _good_encoding),
}


def _stall(server: Server, path: str, content_type: str, declared: int) -> socket.socket:
    """A connection that sends a request's headers, declaring ``declared`` bytes, then nothing."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {declared}\r\n\r\n".encode())
    return sock


def _answer(sock: socket.socket) -> bytes:
    """The server's reply up to the end of its JSON body (the socket's timeout bounds the wait:
    a server that waits for the body fails the test, it does not hang it)."""
    received = b""
    while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


@pytest.mark.parametrize("route", list(ROUTES))
def test_stalled_declarations_past_the_bound_are_413_at_once_and_a_good_request_is_served(request, route):
    fixture, path, content_type, _, good = ROUTES[route]
    server = request.getfixturevalue(fixture)
    with ExitStack() as stalled:
        sockets = [stalled.enter_context(_stall(server, path, content_type, GIGABYTE)) for _ in range(STALLED)]
        # Nothing was sent after the headers, so a reply at all means nothing was waited for;
        # a 413 (not the read deadline's 408) means the declared length alone refused it.
        for sock in sockets:
            reply = _answer(sock)
            assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
            assert f"declares {GIGABYTE} bytes (Content-Length)".encode() in reply, reply[:600]
        assert good(server) == 200  # while the four connections are still open


@pytest.mark.parametrize("route", list(ROUTES))
def test_stalled_declarations_within_the_bound_hold_no_share_of_the_budget(request, route):
    fixture, path, content_type, within, good = ROUTES[route]
    server = request.getfixturevalue(fixture)
    rejected = server.metrics().get("vlmd_requests_overloaded_total")
    with ExitStack() as stalled:
        for _ in range(STALLED):  # by Content-Length they would fill the whole budget
            stalled.enter_context(_stall(server, path, content_type, within))
        assert good(server) == 200
        assert good(server) == 200
    assert server.metrics().get("vlmd_requests_overloaded_total") == rejected


def _send_chunked(server: Server, path: str, content_type: str, pieces) -> bytes:
    """A body without Content-Length (chunked), sent piece by piece until the server answers
    or the pieces end; the server's reply."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        try:
            for piece in pieces:
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed while this was still sending
            pass
        return _answer(sock)


def test_a_chunked_json_body_is_charged_as_it_arrives_and_refused_past_the_bound(llava_server):
    # Short runs between quotes (the text scan passes them), few values (the values bound passes
    # them), 1 MiB a piece, 65 MiB in all.
    piece = (b'"' + b"a" * (2**17 - 3) + b'",') * 8
    pieces = [b'{"model": "tiny", "pad": [', *[piece] * 65, b'""]}']
    reply = _send_chunked(llava_server, "/v1/chat/completions", "application/json", pieces)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert f"larger than the limit of {64 * 2**20} bytes (--max-request-bytes)".encode() in reply, reply[:600]
    assert _good_chat(llava_server) == 200


def test_a_chunked_form_is_refused_past_the_forms_bound(whisper_server):
    # 70 'include' fields of 60 kB (each under the 64 KiB field bound): 4.2 MB, past the
    # 3 MB upload bound + 1 MiB for the fields, with no file at all.
    boundary = "b0undary"
    field = (f'--{boundary}\r\nContent-Disposition: form-data; name="include[]"\r\n\r\n'.encode()
             + b"x" * 60_000 + b"\r\n")
    pieces = [field] * 70 + [f"--{boundary}--\r\n".encode()]
    reply = _send_chunked(whisper_server, "/v1/audio/transcriptions", f"multipart/form-data; boundary={boundary}",
                          pieces)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert f"larger than the limit of {3_000_000 + 2**20} bytes".encode() in reply, reply[:600]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_long_text_run_is_refused_while_the_body_streams_in(llava_server, chunked):
    # 2 MB of one word: past 12 bytes x the 30,720-character bound, so the scan refuses it
    # (its own message) before the body is parsed, with or without a Content-Length.
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"a" * 2_000_000 + b'"}]}'
    if chunked:
        reply = _send_chunked(llava_server, "/v1/chat/completions", "application/json",
                              [body[start:start + 2**16] for start in range(0, len(body), 2**16)])
        status, raw = int(reply[9:12]), reply.split(b"\r\n\r\n", 1)[1]
    else:
        status, raw = llava_server.request("POST", "/v1/chat/completions", body)
    assert_error(status, raw, 400, "holds a run of more than 368640 bytes outside any data: url", param="messages")


def _responses_with_tools(server: Server, count: int) -> tuple[int, dict]:
    body = b'{"model": "%s", "input": "hi", "tools": [%s]}' % (server.model.encode(), b",".join([b'""'] * count))
    status, raw = server.request("POST", "/v1/responses", body)
    return status, orjson.loads(raw)


def test_a_body_of_more_json_values_than_the_bound_is_refused_unparsed(llava_server):
    """Issue 50: a huge ``tools`` list took seconds to parse on the event loop. Past
    --max-request-json-values (2**18 by default) a body is refused from its commas and
    brackets as it streams in; below it, it is parsed and refused for what it says."""
    status, body = _responses_with_tools(llava_server, 2**18 - 8)  # just under 2**18 values: parsed
    assert_error(status, body, 400, "'tools' is not supported", param="tools")
    status, body = _responses_with_tools(llava_server, 2**18 + 8)
    assert_error(status, body, 400, "more than 262144 JSON values", "--max-request-json-values")
    _good_chat(llava_server)


def test_the_json_values_bound_is_never_below_the_values_a_parse_makes():
    from vlmd.server.body import json_values_bound

    def values(value) -> int:
        if isinstance(value, dict):
            return 1 + sum(values(v) for v in value.values())  # keys are strings of their object
        if isinstance(value, list):
            return 1 + sum(values(v) for v in value)
        return 1

    rng = np.random.default_rng(0)

    def random_value(depth: int):
        kind = rng.integers(0, 5 if depth < 4 else 3)
        if kind == 0:
            return int(rng.integers(-5, 5))
        if kind == 1:
            return "a,b" if rng.random() < 0.3 else "x"
        if kind == 2:
            return None
        if kind == 3:
            return [random_value(depth + 1) for _ in range(rng.integers(0, 4))]
        return {f"k{i}": random_value(depth + 1) for i in range(rng.integers(0, 4))}

    for _ in range(200):
        value = random_value(0)
        assert 1 + json_values_bound(orjson.dumps(value)) >= values(value)
    assert 1 + json_values_bound(b'[1, 2, {"a": 3, "b": [4]}]') == values([1, 2, {"a": 3, "b": [4]}])  # no slack
