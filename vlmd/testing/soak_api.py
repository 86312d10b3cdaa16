"""The whole API's soak mix (issue 36 item 4): what ``vlmd.testing.soak`` sends to a vision
server (Qwen2-VL: images and video) and to an audio server (Qwen2-Audio), and a runner that
soaks both at once.

Every good request is greedy, so its answer is exact: chat with an image, two images, a
video, a clip; text completions; a response; structured outputs (a choice list, a JSON
schema); three choices at once; penalties; streams, read to the end or dropped after the
first event. Mixed in: the hostile cases of issue 36 (a schema whose references never end,
100,000 choices, bad media of every modality, wrong shapes, oversize bodies, over-long
text), a client whose body stops arriving (a 408 at the server's read deadline) and, from
issue 50, uploads that declare 1 GB and send nothing (each a 413 at once, and the good
requests beside them unaffected: no 503 is an expected outcome). The vision server's only
encoder server (``--encoder-urls``) is hostile (``vlmd.testing.hostile_encoder``, cycling
``HOSTILE_ENCODER_MODES``): every item it is asked for meets a wrong shape, NaN, another
model, a silence or a drip, and is encoded by the server itself within
``--encoder-timeout-s``, so its answers are still exact. The
vision server runs with a small KV cache, so requests are preempted and recomputed while
their answers are checked.
"""

from __future__ import annotations

import base64
import io
import threading
import wave

import numpy as np
import orjson
from vlmd.testing.soak import Scenario, SoakResult, png_url, random_image, run_soak

AUDIO_RATE = 16_000
MAX_REQUEST_BYTES = 8 * 2**20
# The servers' flags (tests/test_soak_api.py, contrib/bench/soak_api.py). A short read
# deadline, so a stalled body is answered within the soak; the vision server's items bounded
# (8 frames a video, 224 x 224 pixels an image) so its longest prompt fits 640 tokens, and a
# cache of 40 blocks of 16, which the "preempt" request alone overflows.
COMMON_FLAGS = ("--request-read-timeout", "2", "--keepalive-timeout", "2", "--max-request-bytes",
                str(MAX_REQUEST_BYTES), "--mm-processor-cache-gb", "0.05")
VISION_FLAGS = ("--limit-mm-per-prompt", "image=2,video=1", "--media-io-kwargs", '{"video": {"num_frames": 8}}',
                "--mm-processor-kwargs", '{"max_pixels": 50176}', "--max-model-len", "640", "--num-kv-blocks", "40",
                "--max-num-batched-tokens", "256")
AUDIO_FLAGS = ("--limit-mm-per-prompt", "audio=1", "--max-model-len", "2048")
# What the vision server's hostile encoder server answers, in turn.
HOSTILE_ENCODER_MODES = ("wide", "nan", "hang", "rows", "drip-body", "model", "inf", "drip-headers")


def hostile_encoder_flags(url: str) -> tuple[str, ...]:
    """A server's flags for its one encoder server at ``url`` (hostile): a second a try."""
    return ("--encoder-urls", url, "--encoder-timeout-s", "1")


def video_url(seed: int, frames: int = 8, width: int = 112, height: int = 84) -> str:
    """A short MPEG-4 video of random frames, as a data URL (PyAV, as the server decodes it)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            frame = np.asarray(random_image(seed * 1000 + index, width, height))
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buffer.getvalue()).decode()


def wav_bytes(seed: int, seconds: float = 2.0) -> bytes:
    """A gliding tone in a little noise, 16-bit mono WAV: a different clip per seed."""
    t = np.arange(int(seconds * AUDIO_RATE)) / AUDIO_RATE
    rng = np.random.default_rng(seed)
    tone = 0.3 * np.sin(2 * np.pi * (200 + 80 * seed + 40 * t) * t) + 0.03 * rng.standard_normal(t.shape[0])
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(AUDIO_RATE)
        out.writeframes((np.clip(tone, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def _common(model: str, max_request_bytes: int) -> tuple:
    """Builders, and the cases every server gets: text paths and the hostile bodies."""
    def chat(content, **extra) -> bytes:
        messages = [{"role": "user", "content": content}]
        return orjson.dumps({"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **extra})

    def post(path: str, **fields) -> bytes:
        return orjson.dumps({"model": model, "temperature": 0, **fields})

    cyclic = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 6}}, "required": ["colour"]}
    good = [
        Scenario("text", chat("Tell me about zebras."), 200, check_answer=True),
        Scenario("completion", post("/v1/completions", prompt="Once upon a time", max_tokens=8),
                 200, check_answer=True, path="/v1/completions"),
        Scenario("completion-stream", post("/v1/completions", prompt="The river", max_tokens=8, stream=True),
                 200, check_answer=True, path="/v1/completions", stream=True),
        Scenario("response", post("/v1/responses", input="Name three fruits.", max_output_tokens=8),
                 200, check_answer=True, path="/v1/responses"),
        Scenario("choice", chat("Pick a colour.", structured_outputs={"choice": ["red", "green", "blue"]}),
                 200, check_answer=True),
        Scenario("json-schema", chat("A colour as JSON.", max_tokens=16, response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": schema}}), 200, check_answer=True),
        Scenario("n3", chat("Count to three.", n=3), 200, check_answer=True),
        Scenario("penalties", chat("Say it again and again.", max_tokens=12, presence_penalty=0.6,
                                   frequency_penalty=0.4, repetition_penalty=1.3), 200, check_answer=True),
    ]
    hostile = [
        Scenario("cyclic-ref", chat("x", response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": cyclic}}), 400),
        Scenario("choices-100k", chat("x", structured_outputs={"choice": [f"option {i}" for i in range(100_000)]}),
                 400),
        Scenario("bad-base64", chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]), 400),
        Scenario("json-shape", orjson.dumps({"model": model, "messages": {"role": "user"}}), 400),
        Scenario("json-broken", b'{"model": "x", "messages": [', 400),
        Scenario("long-text", chat("a" * 2_000_000), 400),
        Scenario("oversize-body", b'{"pad": "' + b"a" * (max_request_bytes + 1024) + b'"}', 413),
        Scenario("declared-1gb", b"", 413, declare=2**30),
    ]
    return chat, good, hostile


def vision_mix(model: str, max_request_bytes: int) -> list[Scenario]:
    """For a server that takes images and video (``--limit-mm-per-prompt image>=2,video>=1``)."""
    chat, good, hostile = _common(model, max_request_bytes)

    def image(seed: int, width: int, height: int) -> dict:
        return {"type": "image_url", "image_url": {"url": png_url(random_image(seed, width, height))}}

    video = {"type": "video_url", "video_url": {"url": video_url(1)}}
    good = good + [
        Scenario("image", chat([image(1, 96, 64), {"type": "text", "text": "Describe it."}]), 200, check_answer=True),
        Scenario("two-images", chat([image(2, 64, 96), image(3, 80, 80), {"type": "text", "text": "Compare."}]),
                 200, check_answer=True),
        Scenario("video", chat([video, {"type": "text", "text": "What happens?"}]), 200, check_answer=True),
        Scenario("image-stream", chat([image(4, 72, 72), {"type": "text", "text": "A story."}], stream=True),
                 200, check_answer=True, stream=True),
        Scenario("image-long", chat([image(5, 96, 96), {"type": "text", "text": "Go on."}], max_tokens=96,
                                    ignore_eos=True), 200, check_answer=True),
        # Four choices of 160 tokens need 40 blocks of 16 besides the prompt's: under
        # VISION_FLAGS' cache of 40 this request alone is preempted.
        Scenario("preempt", chat([image(7, 96, 96), {"type": "text", "text": "Keep going."}], n=4, max_tokens=160,
                                 ignore_eos=True), 200, check_answer=True),
    ]
    not_video = "data:video/mp4;base64," + base64.b64encode(b"\x00\x00\x00\x18ftypmp42" + b"\x01" * 400).decode()
    hostile = hostile + [
        Scenario("disconnect", chat([image(6, 80, 80), {"type": "text", "text": "Long story."}], max_tokens=200,
                                    ignore_eos=True, stream=True), 200, stream=True, disconnect=True),
        Scenario("not-an-image", chat([{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"GIF89a" * 50).decode()}}]), 400),
        Scenario("not-a-video", chat([{"type": "video_url", "video_url": {"url": not_video}}]), 400),
        Scenario("stalled-body", chat("This body never ends."), 408, stall=True),
    ]
    return good * 2 + hostile  # good requests dominate; every hostile kind still comes round


def audio_mix(model: str, max_request_bytes: int) -> list[Scenario]:
    """For a server that takes audio (Qwen2-Audio)."""
    chat, good, hostile = _common(model, max_request_bytes)

    def clip(seed: int) -> dict:
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(seed)).decode(),
                                                       "format": "wav"}}

    good = good + [
        Scenario("audio", chat([clip(1), {"type": "text", "text": "What is this sound?"}]), 200, check_answer=True),
        Scenario("audio-url", chat([{"type": "audio_url", "audio_url": {
            "url": "data:audio/wav;base64," + base64.b64encode(wav_bytes(2)).decode()}},
            {"type": "text", "text": "Describe it."}]), 200, check_answer=True),
        Scenario("audio-stream", chat([clip(3), {"type": "text", "text": "And this?"}], stream=True),
                 200, check_answer=True, stream=True),
    ]
    hostile = hostile + [
        Scenario("disconnect", chat([clip(4), {"type": "text", "text": "Long story."}], max_tokens=200,
                                    ignore_eos=True, stream=True), 200, stream=True, disconnect=True),
        Scenario("not-audio", chat([{"type": "input_audio", "input_audio": {
            "data": base64.b64encode(b"RIFF" + b"\x07" * 300).decode(), "format": "wav"}}]), 400),
    ]
    return good * 2 + hostile


def run_api_soak(targets: list[dict], *, max_requests: int, max_seconds: float, clients: int = 4,
                 timeout: float = 120.0) -> dict[str, SoakResult]:
    """Soak every target at once. A target: ``name``, ``url``, ``pid``, ``model``, ``mix``
    (``vision_mix`` or ``audio_mix``), ``max_request_bytes``. ``max_requests`` and
    ``clients`` are per target. Returns each target's result by name."""
    results: dict[str, SoakResult] = {}

    def soak(target: dict) -> None:
        mix = target["mix"](target["model"], target["max_request_bytes"])
        results[target["name"]] = run_soak(target["url"], target["pid"], target["model"], mix=mix,
                                           max_requests=max_requests, max_seconds=max_seconds, clients=clients,
                                           timeout=timeout)

    threads = [threading.Thread(target=soak, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    missing = [target["name"] for target in targets if target["name"] not in results]
    if missing:
        raise RuntimeError(f"the soak of {', '.join(missing)} did not finish (see the exception above)")
    return results

