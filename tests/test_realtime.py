"""GET /v1/realtime through a real WebSocket client (aiohttp's) against Whisper tiny.en: a
real espeak clip sent in 100 ms pcm16 chunks gets text deltas before it is committed and,
once committed, the offline transcription's text; bad events are error events that leave
the session open; a silent client is closed by the read deadline; bounds hold."""

from __future__ import annotations

import asyncio
import base64
import io

import aiohttp
import numpy as np
import orjson
import pytest
import soundfile

from conftest import Server
from whisper_support import needs_espeak, needs_tiny_en, post_audio, speech_wav

pytestmark = [needs_espeak, needs_tiny_en]

RATE = 24_000  # OpenAI's pcm16
CHUNK = RATE // 10  # 100 ms
READ_TIMEOUT_S = 3
MAX_SECONDS = 20
TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny morning in the park."
WAIT_S = 180.0  # generous: a bound on a hang, not on speed


@pytest.fixture(scope="module")
def server(tiny_en_dir, tmp_path_factory):
    server = Server(tiny_en_dir, "--request-read-timeout", str(READ_TIMEOUT_S),
                    "--media-io-kwargs", orjson.dumps({"audio": {"max_duration_s": MAX_SECONDS}}).decode(),
                    name="whisper-tiny.en", log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def pcm16(wav: bytes) -> bytes:
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    assert rate == RATE
    return samples.astype("<i2").tobytes()


def append(pcm: bytes) -> str:
    return orjson.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}).decode()


async def next_event(socket, timeout: float = WAIT_S) -> dict:
    message = await socket.receive(timeout=timeout)
    assert message.type == aiohttp.WSMsgType.TEXT, message
    return orjson.loads(message.data)


async def until(socket, kind: str, seen: list[dict]) -> dict:
    """Events up to the first of ``kind`` (kept in ``seen``), which is returned."""
    while True:
        event = await next_event(socket)
        seen.append(event)
        if event["type"] == kind:
            return event
        assert event["type"] != "error", event


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_spoken_clip_in_100_ms_chunks_ends_with_the_offline_text_and_deltas_come_before_the_commit(server):
    wav = speech_wav(TEXT, rate=RATE)
    status, raw = post_audio(server, {"response_format": "json"}, wav)
    assert status == 200, raw
    offline = orjson.loads(raw)["text"]
    assert "quick brown fox" in offline.lower()

    async def session():
        pcm = pcm16(wav)
        async with aiohttp.ClientSession() as client:
            async with client.ws_connect(server.url + "/v1/realtime?intent=transcription") as socket:
                created = await next_event(socket)
                assert created["type"] == "transcription_session.created"
                await socket.send_str(orjson.dumps({"type": "transcription_session.update", "session": {
                    "input_audio_format": "pcm16", "turn_detection": None,
                    "input_audio_transcription": {"model": server.model}}}).decode())
                seen: list[dict] = []
                await until(socket, "transcription_session.updated", seen)
                for start in range(0, len(pcm), 2 * CHUNK):  # 100 ms of audio every 100 ms, as a live microphone
                    await socket.send_str(append(pcm[start:start + 2 * CHUNK]))
                    await asyncio.sleep(0.1)
                before_commit: list[dict] = []
                await until(socket, "conversation.item.input_audio_transcription.delta", before_commit)
                await socket.send_str(orjson.dumps({"type": "input_audio_buffer.commit"}).decode())
                after: list[dict] = []
                completed = await until(socket, "conversation.item.input_audio_transcription.completed", after)
                return before_commit, after, completed

    before_commit, after, completed = run(session())
    assert completed["transcript"] == offline
    committed = [event for event in after if event["type"] == "input_audio_buffer.committed"]
    assert len(committed) == 1 and committed[0]["item_id"] == completed["item_id"]
    deltas = [event for event in before_commit + after
              if event["type"] == "conversation.item.input_audio_transcription.delta"]
    assert deltas[0] in before_commit  # said while the clip was still open
    assert all(event["item_id"] == completed["item_id"] for event in deltas)
    assert "".join(event["delta"] for event in deltas) == completed["transcript"]


def test_bad_events_are_error_events_and_the_session_goes_on(server):
    async def session():
        async with aiohttp.ClientSession() as client:
            async with client.ws_connect(server.url + "/v1/realtime") as socket:
                await next_event(socket)
                errors = []
                for event in (
                    "not json",
                    {"type": "response.create"},
                    {"type": "input_audio_buffer.append", "audio": "not*base64"},
                    {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x00\x01\x02").decode()},
                    {"type": "input_audio_buffer.commit"},
                    {"type": "session.update", "session": {"turn_detection": {"type": "server_vad"}}},
                    {"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}},
                    {"type": "session.update", "session": {"input_audio_transcription": {"language": "de"}}},
                    {"type": "session.update", "session": {"input_audio_transcription": {"model": "other"}}},
                    {"type": "session.update", "session": {"voice": "alloy"}},
                ):
                    await socket.send_str(event if isinstance(event, str) else orjson.dumps(event).decode())
                    errors.append(await next_event(socket))
                await socket.send_str(append(np.zeros(CHUNK, "<i2").tobytes()))
                await socket.send_str(orjson.dumps({"type": "input_audio_buffer.clear"}).decode())
                cleared = await next_event(socket)
                return errors, cleared

    errors, cleared = run(session())
    assert [event["type"] for event in errors] == ["error"] * len(errors)
    messages = [event["error"]["message"] for event in errors]
    for fragment, message in zip(("JSON object", "not served", "not valid base64", "whole 16-bit samples",
                                  "buffer is empty", "turn_detection must be null", "pcm16",
                                  "English only", "does not exist", "session.voice"), messages):
        assert fragment in message, (fragment, message)
    assert errors[4]["error"]["code"] == "input_audio_buffer_commit_empty"
    assert cleared["type"] == "input_audio_buffer.cleared"


def test_a_silent_client_is_closed_by_the_read_deadline(server):
    async def session():
        async with aiohttp.ClientSession() as client:
            async with client.ws_connect(server.url + "/v1/realtime") as socket:
                await next_event(socket)
                error = await next_event(socket, timeout=WAIT_S)  # sent nothing: the deadline passes
                closing = await socket.receive(timeout=WAIT_S)
                return error, closing, socket.close_code

    error, closing, code = run(session())
    assert error["type"] == "error" and error["error"]["code"] == "session_idle"
    assert f"no event for {READ_TIMEOUT_S} s" in error["error"]["message"]
    assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    assert code == 1008


def test_a_client_that_does_not_read_is_closed_by_the_deadline(server):
    """Every bad event is answered with an error event; a client that sends them and reads
    nothing fills the socket's buffers, the server's send waits, and past the read deadline
    the server closes the session instead of waiting for ever."""
    bad = orjson.dumps({"type": "no.such.event." + "x" * 4000}).decode()  # its error event names the type

    async def session():
        async with aiohttp.ClientSession() as client:
            async with client.ws_connect(server.url + "/v1/realtime") as socket:
                await next_event(socket)
                sent = 0
                for _ in range(20_000):  # ~80 MB of error events asked for, none read
                    try:  # far longer than the server's deadline: only a server that stopped reading stops this
                        await asyncio.wait_for(socket.send_str(bad), 10 * READ_TIMEOUT_S)
                    except (asyncio.TimeoutError, ConnectionResetError):
                        break  # the server stopped reading (its send is stuck) or closed
                    if socket.closed:
                        break
                    sent += 1
                while True:  # now read: what was sent, then the end of the session
                    message = await socket.receive(timeout=WAIT_S)
                    if message.type != aiohttp.WSMsgType.TEXT:
                        return sent, message.type, socket.close_code

    sent, last, code = run(session())
    assert sent < 20_000  # the server stopped taking events before the client ran out of them
    assert last in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING,
                     aiohttp.WSMsgType.ERROR)
    assert "realtime client not reading" in server.log_path.read_text()


def test_an_item_longer_than_the_audio_bound_is_refused_and_the_buffer_kept(server):
    async def session():
        async with aiohttp.ClientSession() as client:
            async with client.ws_connect(server.url + "/v1/realtime") as socket:
                await next_event(socket)
                second = np.zeros(RATE, "<i2").tobytes()
                for _ in range(MAX_SECONDS):
                    await socket.send_str(append(second))
                await socket.send_str(append(second))  # one second past the bound
                seen: list[dict] = []
                while True:
                    event = await next_event(socket)
                    if event["type"] == "error":
                        break
                    seen.append(event)
                await socket.send_str(orjson.dumps({"type": "input_audio_buffer.clear"}).decode())
                await until(socket, "input_audio_buffer.cleared", seen)
                return event

    error = run(session())
    assert f"more than {MAX_SECONDS} s of audio" in error["error"]["message"]


def test_a_model_without_audio_refuses_the_upgrade(llava_server):
    async def session():
        async with aiohttp.ClientSession() as client:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await client.ws_connect(llava_server.url + "/v1/realtime")
            return refused.value.status

    assert run(session()) == 400


def test_the_api_key_guards_the_upgrade(tiny_whisper_dir, tmp_path):
    keyed = Server(tiny_whisper_dir, "--api-key", "sesame", name="tiny-whisper", log_dir=tmp_path)
    try:
        async def session():
            async with aiohttp.ClientSession() as client:
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await client.ws_connect(keyed.url + "/v1/realtime", headers={"Authorization": "Bearer wrong"})
                async with client.ws_connect(keyed.url + "/v1/realtime",
                                             headers={"Authorization": "Bearer sesame"}) as socket:
                    created = await next_event(socket)
                return refused.value.status, created["type"]

        assert run(session()) == (401, "transcription_session.created")
    finally:
        keyed.stop()
