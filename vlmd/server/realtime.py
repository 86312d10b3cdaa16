"""GET /v1/realtime: live transcription over a WebSocket, in OpenAI's realtime events.

A session (``?intent=transcription``, as OpenAI's; the served model as ``?model=`` if
given) receives audio in pieces and sends text back while it arrives:

- the client may send ``transcription_session.update`` (or ``session.update``) with
  OpenAI's transcription-session fields: ``input_audio_format`` (``pcm16``: 16-bit
  little-endian mono at 24 kHz, OpenAI's), ``input_audio_transcription``
  (``model``, ``language``, ``prompt``), ``turn_detection: null`` (vlmd has no voice-activity
  detection: the client commits), ``input_audio_noise_reduction: null``; anything else is an
  ``error`` event naming the field;
- ``input_audio_buffer.append`` (``audio``: base64 of pcm16) grows the current item's
  buffer. Every ``PARTIAL_EVERY_S`` seconds of new audio the whole buffer so far is
  transcribed once (one decode per window, as a streamed transcription is) and the words two
  such partial transcripts agree on, the last one held back, go out as
  ``conversation.item.input_audio_transcription.delta`` events: the deltas of an item arrive
  while it is being spoken, before the commit;
- ``input_audio_buffer.commit`` ends the item (``input_audio_buffer.committed``) and
  transcribes its audio exactly as ``/v1/audio/transcriptions`` transcribes the same samples
  uploaded as a 24 kHz WAV (the same resampling, windows, temperature fallback): its text is
  ``conversation.item.input_audio_transcription.completed``'s ``transcript``. Where that text
  continues what the deltas said, a last delta sends the rest, so the deltas join to it;
  ``input_audio_buffer.clear`` drops the buffer.

Bounds: an event is at most ``MAX_EVENT_BYTES``; an item's audio at most the audio upload
bounds (``--media-io-kwargs`` audio ``max_bytes`` and ``max_duration_s``), and its buffer
is held on the decoded-media budget (``--max-inflight-media-gb``); a client must send an
event within ``--request-read-timeout`` of the last (unless what it sent is still being
transcribed) and read what is sent within the same time, and a session lasts at most the
longest audio plus that timeout: past these it gets an ``error`` event and the socket is
closed (code 1008). Under ``--api-key`` the upgrade needs the key, as every route does.
Decisions: docs/decisions.md, D104.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import uuid

import numpy as np
import orjson
import structlog
from aiohttp import WSMsgType, web

from vlmd.errors import BadRequestError, NotFoundError, RequestTimeoutError, VlmdError
from vlmd.media.audio import resample
from vlmd.processing.speech import TranscriptionOptions
from vlmd.processing.temperature_fallback import FallbackThresholds
from vlmd.server.audio import transcript_text, window_prompts
from vlmd.server.audio_decode import DecodeSettings, decode_windows
from vlmd.server.state import ServerState

log = structlog.get_logger(__name__)

PCM_RATE = 24_000  # OpenAI's pcm16
PCM_BYTES = 2
PARTIAL_EVERY_S = 1.0
MAX_EVENT_BYTES = 4 << 20  # ~65 s of pcm16 at 24 kHz in one append, base64 included
CLOSE_POLICY = 1008  # WebSocket close code: policy violation (a deadline or a bound)
_SESSION_FIELDS = {"type", "input_audio_format", "input_audio_transcription", "turn_detection",
                   "input_audio_noise_reduction", "include"}
_TRANSCRIPTION_FIELDS = {"model", "language", "prompt"}


class SessionEnded(Exception):
    """The client cannot be written to any more (gone, or not reading)."""


async def realtime(request: web.Request) -> web.WebSocketResponse:
    state: ServerState = request.app["state"]
    if state.transcriber is None:
        raise BadRequestError(f"the model `{state.config.model_name}` does not take audio; /v1/realtime needs a "
                              "speech-to-text model", param="model")
    model = request.query.get("model")
    if model is not None and model != state.config.model_name:
        raise NotFoundError(f"The model `{model}` does not exist.", param="model", code="model_not_found")
    intent = request.query.get("intent", "transcription")
    if intent != "transcription":
        raise BadRequestError(f"intent {intent!r} is not served: /v1/realtime transcribes (intent=transcription)",
                              param="intent")
    state.admission.check_capacity()
    socket = web.WebSocketResponse(max_msg_size=MAX_EVENT_BYTES)
    await socket.prepare(request)
    await RealtimeSession(state, socket).run()
    return socket


class _Item:
    """One item being spoken: its pcm16, its share of the media budget, what was said of it."""

    def __init__(self, lease):
        self.id = f"item_{uuid.uuid4().hex[:24]}"
        self.audio = bytearray()
        self.lease = lease
        self.partial_at = 0  # bytes the last partial transcript started from
        self.hypothesis = ""  # the last partial transcript
        self.emitted = ""  # what the deltas have said, joined


class RealtimeSession:
    def __init__(self, state: ServerState, socket: web.WebSocketResponse):
        self.state = state
        self.socket = socket
        self.transcriber = state.transcriber
        policy = self.transcriber.policy
        self.timeout_s = state.config.request_read_timeout
        self.max_bytes = min(policy.max_audio_bytes, int(policy.max_audio_duration_s * PCM_RATE) * PCM_BYTES)
        loop = asyncio.get_running_loop()
        self.expires = loop.time() + policy.max_audio_duration_s + self.timeout_s
        self.options = TranscriptionOptions(task="transcribe")
        self.item: _Item | None = None
        self.previous_item_id: str | None = None
        self.partial: asyncio.Task | None = None
        self.final: asyncio.Task | None = None  # the last committed item's transcription (they finish in order)
        self._send_lock = asyncio.Lock()

    # ---- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self.send({"type": "transcription_session.created", "session": self.session()})
            while True:
                left = self.expires - loop.time()
                if left <= 0:
                    await self.close_for("session_expired", f"a session lasts at most {self.expires_after:g} s "
                                         "(the longest audio, --media-io-kwargs audio max_duration_s, plus "
                                         "--request-read-timeout)")
                    return
                try:
                    message = await self.socket.receive(timeout=min(self.timeout_s, left))
                except asyncio.TimeoutError:
                    if self.transcribing:
                        continue  # the client waits for what it sent to be transcribed
                    await self.close_for("session_idle", f"no event for {self.timeout_s:g} s (--request-read-timeout)")
                    return
                if message.type == WSMsgType.TEXT:
                    await self.handle(message.data)
                elif message.type == WSMsgType.BINARY:
                    await self.error(BadRequestError("events are JSON text messages"), None)
                else:  # closed by the client, or an error aiohttp answered (a message past MAX_EVENT_BYTES)
                    return
        except SessionEnded:
            return
        finally:
            for task in (self.partial, self.final):
                if task is not None:
                    task.cancel()
            if self.item is not None:
                self.item.lease.release()
            await self.socket.close()

    @property
    def transcribing(self) -> bool:
        """Whether a transcript of what the client sent is still being made."""
        return any(task is not None and not task.done() for task in (self.partial, self.final))

    @property
    def expires_after(self) -> float:
        return self.transcriber.policy.max_audio_duration_s + self.timeout_s

    async def handle(self, data: str) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            await self.error(BadRequestError("an event must be a JSON object"), None)
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            await self.error(BadRequestError("an event must be a JSON object with a string 'type'"), None)
            return
        kind, event_id = event["type"], event.get("event_id")
        try:
            if kind in ("transcription_session.update", "session.update"):
                await self.update(event.get("session"), kind.replace(".update", ".updated"))
            elif kind == "input_audio_buffer.append":
                await self.append(event.get("audio"))
            elif kind == "input_audio_buffer.commit":
                await self.commit()
            elif kind == "input_audio_buffer.clear":
                await self.clear()
            else:
                raise BadRequestError(f"event type {kind!r} is not served: a transcription session takes "
                                      "transcription_session.update and input_audio_buffer.append, commit and clear",
                                      param="type")
        except VlmdError as exc:
            await self.error(exc, event_id)

    # ---- client events -------------------------------------------------------------------

    async def update(self, session, reply: str) -> None:
        if not isinstance(session, dict):
            raise BadRequestError("session must be an object", param="session")
        unknown = sorted(set(session) - _SESSION_FIELDS)
        if unknown:
            raise BadRequestError(f"session.{unknown[0]} is not supported", param=f"session.{unknown[0]}")
        if session.get("type") not in (None, "transcription"):
            raise BadRequestError("session.type must be 'transcription'", param="session.type")
        if session.get("input_audio_format") not in (None, "pcm16"):
            raise BadRequestError("session.input_audio_format must be 'pcm16' (16-bit mono at 24 kHz)",
                                  param="session.input_audio_format")
        if session.get("turn_detection") is not None:
            raise BadRequestError("session.turn_detection must be null: vlmd detects no turns, the client commits "
                                  "the buffer (input_audio_buffer.commit)", param="session.turn_detection")
        if session.get("input_audio_noise_reduction") is not None:
            raise BadRequestError("session.input_audio_noise_reduction must be null: vlmd reduces no noise",
                                  param="session.input_audio_noise_reduction")
        if session.get("include") not in (None, []):
            raise BadRequestError("session.include must be empty: no log-probs are sent", param="session.include")
        transcription = session.get("input_audio_transcription") or {}
        if not isinstance(transcription, dict):
            raise BadRequestError("session.input_audio_transcription must be an object",
                                  param="session.input_audio_transcription")
        unknown = sorted(set(transcription) - _TRANSCRIPTION_FIELDS)
        if unknown:
            raise BadRequestError(f"session.input_audio_transcription.{unknown[0]} is not supported",
                                  param="session.input_audio_transcription")
        model = transcription.get("model")
        if model is not None and model != self.state.config.model_name:
            raise NotFoundError(f"The model `{model}` does not exist.", param="session.input_audio_transcription.model",
                                code="model_not_found")
        language, prompt = transcription.get("language"), transcription.get("prompt")
        for name, value in (("language", language), ("prompt", prompt)):
            if value is not None and not isinstance(value, str):
                raise BadRequestError(f"session.input_audio_transcription.{name} must be a string",
                                      param=f"session.input_audio_transcription.{name}")
        options = TranscriptionOptions(task="transcribe", language=language or None, prompt=prompt or None)
        self.transcriber.check(options)
        self.options = options
        await self.send({"type": reply, "session": self.session()})

    async def append(self, audio) -> None:
        if not isinstance(audio, str) or not audio:
            raise BadRequestError("audio must be a non-empty base64 string of pcm16", param="audio")
        try:
            pcm = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequestError("audio is not valid base64", param="audio") from None
        if len(pcm) % PCM_BYTES:
            raise BadRequestError("audio must hold whole 16-bit samples (an even number of bytes)", param="audio")
        if self.item is None:
            self.item = _Item(self.state.admission.media_lease())
        item = self.item
        if len(item.audio) + len(pcm) > self.max_bytes:
            raise BadRequestError(
                f"the item would hold more than {self.max_bytes // PCM_BYTES / PCM_RATE:g} s of audio (the audio "
                "bounds of --media-io-kwargs): commit it", param="audio")
        # The pcm16 and, while it is transcribed, its float32 samples at the model's rate.
        item.lease.hold(3 * len(pcm), "the realtime audio buffer")
        item.audio += pcm
        self._maybe_transcribe_partial()

    async def commit(self) -> None:
        item = self.item
        if item is None or not item.audio:
            raise BadRequestError("the input audio buffer is empty: append audio before committing",
                                  code="input_audio_buffer_commit_empty")
        self.item = None
        if self.partial is not None:
            self.partial.cancel()
        await self.send({"type": "input_audio_buffer.committed", "previous_item_id": self.previous_item_id,
                         "item_id": item.id})
        self.previous_item_id = item.id
        self.final = asyncio.ensure_future(self._transcribe_final(item, self.final))

    async def clear(self) -> None:
        if self.partial is not None:
            self.partial.cancel()
        if self.item is not None:
            self.item.lease.release()
            self.item = None
        await self.send({"type": "input_audio_buffer.cleared"})

    # ---- transcripts ---------------------------------------------------------------------

    def _maybe_transcribe_partial(self) -> None:
        item = self.item
        running = self.partial is not None and not self.partial.done()
        if item is None or running or len(item.audio) - item.partial_at < PARTIAL_EVERY_S * PCM_RATE * PCM_BYTES:
            return
        item.partial_at = len(item.audio)
        self.partial = asyncio.ensure_future(self._transcribe_partial(item, bytes(item.audio)))

    async def _transcribe_partial(self, item: _Item, pcm: bytes) -> None:
        """Best effort: a partial transcript that cannot run now (the server is loaded, the
        item is gone) is skipped; the commit's transcript is the answer."""
        try:
            self.state.admission.check_capacity()
            text = await self.transcribe(pcm, fallback=False)
        except (VlmdError, asyncio.CancelledError):
            return
        stable = agreed_prefix(item.hypothesis, text)
        item.hypothesis = text
        if len(stable) > len(item.emitted) and stable.startswith(item.emitted):
            await self._delta(item, stable[len(item.emitted):])
        if self.item is item:
            self._maybe_transcribe_partial()  # audio that came meanwhile

    async def _transcribe_final(self, item: _Item, previous: asyncio.Task | None) -> None:
        try:
            if previous is not None:  # items complete in the order they were committed
                await asyncio.wait({previous})
            try:
                text = await self.transcribe(bytes(item.audio), fallback=True)
            except VlmdError as exc:
                await self.send({"type": "conversation.item.input_audio_transcription.failed", "item_id": item.id,
                                 "content_index": 0, "error": exc.to_dict()["error"]})
                return
            if text.startswith(item.emitted) and len(text) > len(item.emitted):
                await self._delta(item, text[len(item.emitted):])
            await self.send({"type": "conversation.item.input_audio_transcription.completed", "item_id": item.id,
                             "content_index": 0, "transcript": text})
        except SessionEnded:
            return
        finally:
            item.lease.release()

    async def _delta(self, item: _Item, delta: str) -> None:
        item.emitted += delta
        try:
            await self.send({"type": "conversation.item.input_audio_transcription.delta", "item_id": item.id,
                             "content_index": 0, "delta": delta})
        except SessionEnded:
            return

    async def transcribe(self, pcm: bytes, *, fallback: bool) -> str:
        """``pcm`` transcribed as the same samples uploaded as a 24 kHz 16-bit WAV are:
        decoded to float32 as libsndfile does, resampled to the model's rate with the
        upload's resampler, cut into the upload's windows; with ``fallback`` (a commit) as the
        json answer decodes (openai-whisper's temperature fallback), without (a partial)
        once per window at temperature 0."""
        transcriber = self.transcriber
        rate = transcriber.processor.sampling_rate

        def prepare(deadline):
            samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
            return transcriber.prepare_samples(resample(samples, PCM_RATE, rate))

        prepared = await self.state.admission.preprocess(prepare)
        base_id = f"rt-{uuid.uuid4().hex}"
        _, prompts = await window_prompts(self.state, prepared, self.options, base_id)
        settings = DecodeSettings(base_id, 0.0, None, FallbackThresholds(),
                                  fallback=fallback and transcriber.processor.temperature_fallback)
        decodes = await decode_windows(self.state, prompts, settings, [w.end - w.start for w in prepared.windows])
        return transcript_text(decodes, settings)

    # ---- server events -------------------------------------------------------------------

    def session(self) -> dict:
        return {
            "object": "realtime.transcription_session",
            "input_audio_format": "pcm16",
            "input_audio_transcription": {"model": self.state.config.model_name, "language": self.options.language,
                                          "prompt": self.options.prompt or ""},
            "turn_detection": None,
            "input_audio_noise_reduction": None,
            "include": [],
        }

    async def send(self, event: dict) -> None:
        """One event, within the read deadline: a client that does not read is closed."""
        event = {"event_id": f"event_{os.urandom(12).hex()}", **event}
        async with self._send_lock:
            if self.socket.closed:
                raise SessionEnded
            try:
                await asyncio.wait_for(self.socket.send_str(orjson.dumps(event).decode()), self.timeout_s)
            except (asyncio.TimeoutError, ConnectionResetError) as exc:
                log.info("realtime client not reading; closing", reason=type(exc).__name__)
                await self.socket.close(code=CLOSE_POLICY, message=b"the client did not read the events")
                raise SessionEnded from None

    async def error(self, exc: VlmdError, event_id) -> None:
        body = exc.to_dict()["error"]
        await self.send({"type": "error", "error": {**body, "event_id": event_id}})

    async def close_for(self, code: str, message: str) -> None:
        await self.send({"type": "error", "error": RequestTimeoutError(message, code=code).to_dict()["error"]})
        await self.socket.close(code=CLOSE_POLICY, message=message.encode()[:120])


def agreed_prefix(previous: str, current: str) -> str:
    """What two transcripts of a growing buffer agree on, in whole words, the last word
    held back (more audio may still change it: "jump" then "jumps")."""
    common = os.path.commonprefix([previous, current])
    cut = common.rstrip().rfind(" ")
    return common[:cut] if cut > 0 else ""
