"""Encoder disaggregation through the front door: an ``--encoder-only`` server and a language
server started with ``--encoder-urls``, on 127.0.0.1.

The language server's greedy tokens equal a single server's (the shared ``llava_server``);
its own encoder stays idle while the encoder server's runs; a dead URL is passed over, an
encoder that answers an error falls back to the local encoder, and under
``--encoder-fallback fail`` only the request with media fails, with a message naming each
server. The wire format is read with the documented parser (docs/encoder-wire-format.md)
and carries no pickle; bad input to the encoder route is an OpenAI-shaped 4xx.
"""

from __future__ import annotations

import json
import pickletools
import re
import socketserver
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import orjson
import pytest
from conftest import (Server, free_port, image_data_url, image_message, make_video, qwen2_audio_flags, random_image,
                      video_data_url)
from qwen2_audio_support import encode, input_audio, make_clip, text

from vlmd.encoder_wire import FORMAT, unpack

REPO = Path(__file__).resolve().parent.parent
# No warm-up: seven servers start at once on two cores, and no test times a first request
# for its compile or allocation (the LLaVA one is timed against a timeout far above them).
LLAVA_FLAGS = ("--limit-mm-per-prompt", "image=3", "--max-model-len", "2048", "--no-warmup")
# The encoder server refuses media larger than this (its own bound; a 640x480 test image is
# ~0.8 MB, an 800x600 one ~1.2 MB); the language server takes them, so such an image meets
# an encoder that answers an error.
ENCODER_MAX_BYTES = 1_000_000
# --encoder-timeout-s of the LLaVA language server: a silent encoder costs this much a turn.
SLOW_TIMEOUT_S = 4
VL_FLAGS = ("--max-model-len", "2048", "--no-warmup")


@pytest.fixture(scope="module")
def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def start_together(*specs: tuple[tuple, dict]) -> list[Server]:
    """Servers started at once (each start mostly waits on imports and loading); a language
    server may name an encoder server's URL before it is up (it is first asked after start-up)."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(Server, *args, **kwargs) for args, kwargs in specs]
        servers, errors = [], []
        for future in futures:
            try:
                servers.append(future.result())
            except Exception as exc:  # stop the ones that did start before failing
                errors.append(exc)
    if errors:
        for server in servers:
            server.stop()
        raise errors[0]
    return servers


@pytest.fixture(scope="module")
def slow_url():
    """An encoder that takes the request and never answers (until the module ends)."""
    release = threading.Event()

    class Silent(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(1 << 16)
            release.wait(60)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Silent)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def fleet(tiny_llava_dir, tiny_qwen2_vl_dir, tiny_qwen2_audio_dir, media_dir, llava_server, dead_url, slow_url,
          tmp_path_factory):
    """Every server of the module, started at once (a start mostly waits on one core):
    - LLaVA: an encoder server and a language server that lists a dead URL and a silent one
      before it (its first request, here, meets both failures, timed);
    - Qwen2-VL: an encoder server, a language server and a single server to compare with;
    - Qwen2-Audio: an encoder server (a lower byte bound) and a language server under
      ``--encoder-fallback fail`` (the shared ``qwen2_audio_server`` is the single one)."""
    ports = {name: free_port() for name in ("llava", "qwen2_vl", "audio")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    logs = tmp_path_factory.mktemp("logs")
    timeouts = ("--encoder-timeout-s", "20", "--preprocess-timeout", "30")
    audio_flags = (*qwen2_audio_flags(media_dir), "--max-model-len", "2048", "--no-warmup")
    vl = {"name": "tiny-qwen2-vl", "log_dir": logs}
    audio = {"name": "tiny-audio", "log_dir": logs}
    servers = start_together(
        ((tiny_llava_dir, "--encoder-only", *LLAVA_FLAGS, "--media-max-bytes", str(ENCODER_MAX_BYTES)),
         {"log_dir": logs, "port": ports["llava"]}),
        ((tiny_llava_dir, *LLAVA_FLAGS, "--encoder-urls", f"{dead_url},{slow_url},{url['llava']}",
          "--encoder-timeout-s", str(SLOW_TIMEOUT_S), "--preprocess-timeout", "30"), {"log_dir": logs}),
        ((tiny_qwen2_vl_dir, "--encoder-only", *VL_FLAGS), {**vl, "port": ports["qwen2_vl"]}),
        ((tiny_qwen2_vl_dir, *VL_FLAGS, "--encoder-urls", f"{url['qwen2_vl']},{dead_url}", *timeouts), vl),
        ((tiny_qwen2_vl_dir, *VL_FLAGS), vl),
        ((tiny_qwen2_audio_dir, "--encoder-only", *audio_flags, "--media-io-kwargs", '{"audio": {"max_bytes": 150000}}'),
         {**audio, "port": ports["audio"]}),
        ((tiny_qwen2_audio_dir, *audio_flags, "--encoder-urls", f"{dead_url},{url['audio']}", "--encoder-fallback",
          "fail", *timeouts), audio),
    )
    try:
        names = ("encoder", "language", "vl_encoder", "vl_language", "vl_single", "audio_encoder", "audio_language")
        fleet = SimpleNamespace(**dict(zip(names, servers)), audio_encoder_url=url["audio"])
        before = encoder_forwards(fleet.language)
        messages = image_message("Which colour?", random_image(20, 336, 336))
        started = time.monotonic()
        tokens = greedy(fleet.language, messages, max_tokens=2)
        fleet.first_seconds = time.monotonic() - started
        fleet.first_tokens_equal_a_single_server = tokens == greedy(llava_server, messages, max_tokens=2)
        fleet.local_encodes = encoder_forwards(fleet.language) - before
        yield fleet
    finally:
        for server in servers:  # all told at once, then each waited for
            if server.process.poll() is None:
                server.process.terminate()
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def encoder_server(fleet):
    return fleet.encoder


@pytest.fixture(scope="module")
def language_server(fleet):
    return fleet.language


def greedy(server: Server, messages: list[dict], max_tokens: int = 8) -> list[int]:
    status, body = server.chat({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                "return_token_ids": True})
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def encoder_forwards(server: Server) -> float:
    return server.metrics()["vlmd_encoder_forwards_total"]


def cache_lookups(server: Server) -> float:
    return server.metrics()["vlmd_encoder_cache_queries_total"]


def wait_for_forwards(server: Server, at_least: float) -> float:
    deadline = time.monotonic() + 5
    while (count := encoder_forwards(server)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def test_tokens_equal_a_single_server_and_the_local_encoder_stays_idle(llava_server, language_server, encoder_server):
    requests = [
        image_message("What is in this image?", random_image(1)),
        image_message("Compare them.", random_image(2, 320, 240), random_image(3, 200, 300)),
        image_message("Twice the same.", random_image(4), random_image(4)),
    ]
    local_before, remote_before = encoder_forwards(language_server), encoder_forwards(encoder_server)
    lookups_before = [cache_lookups(server) for server in (language_server, llava_server)]
    for messages in requests:
        assert greedy(language_server, messages) == greedy(llava_server, messages)
    assert encoder_forwards(language_server) == local_before
    # 1 + 2 + 1 distinct items, each encoded once by the encoder server.
    assert wait_for_forwards(encoder_server, remote_before + 4) == remote_before + 4
    # The scheduler's encoder cache looks remote items up as the single server looks up its own.
    lookups = [cache_lookups(server) - before for server, before in zip((language_server, llava_server), lookups_before)]
    assert lookups[0] == lookups[1] > 0


def test_a_second_turn_reuses_the_language_servers_own_encoder_cache(language_server, encoder_server):
    messages = image_message("Describe it.", random_image(5))
    first = greedy(language_server, messages)
    remote = wait_for_forwards(encoder_server, 0)
    assert greedy(language_server, messages) == first
    time.sleep(0.2)
    assert encoder_forwards(encoder_server) == remote  # resident here: not sent again


def test_the_first_request_waits_out_the_silent_encoder_then_the_encoder_answers(fleet):
    """The language server's first request meets the dead URL, then the silent one (timed out
    by --encoder-timeout-s), then the encoder; both failed servers are then asked last, so
    the next request goes to the encoder at once."""
    assert fleet.first_seconds >= SLOW_TIMEOUT_S
    assert fleet.first_tokens_equal_a_single_server
    assert fleet.local_encodes == 0


def test_an_encoder_that_answers_an_error_falls_back_to_the_local_encoder(llava_server, language_server):
    # Over the encoder server's byte bound (its 400), within the language server's.
    messages = image_message("And this one?", random_image(6, 800, 600))
    before = encoder_forwards(language_server)
    assert greedy(language_server, messages) == greedy(llava_server, messages)
    assert encoder_forwards(language_server) == before + 1
    # A request with media the encoder takes is served remotely again.
    messages = image_message("One more.", random_image(7))
    assert greedy(language_server, messages) == greedy(llava_server, messages)
    assert encoder_forwards(language_server) == before + 1


# ---- video (Qwen2-VL) and audio (Qwen2-Audio) ------------------------------------------------


def test_qwen2_vl_video_and_image_through_an_encoder_server(fleet):
    """Video frames and an image, M-RoPE positions and all: the same tokens as one server."""
    encoder, language, single = fleet.vl_encoder, fleet.vl_language, fleet.vl_single
    video = {"type": "video_url", "video_url": {"url": video_data_url(make_video(4, seed=7))}}
    image = {"type": "image_url", "image_url": {"url": image_data_url(random_image(12, 112, 84))}}
    local_before, remote_before = encoder_forwards(language), encoder_forwards(encoder)
    for content in ([video, text("What happens?")], [video, image, text("Compare.")]):
        messages = [{"role": "user", "content": content}]
        assert greedy(language, messages) == greedy(single, messages)
    assert encoder_forwards(language) == local_before
    # The video once (then resident here), the image once.
    assert wait_for_forwards(encoder, remote_before + 2) == remote_before + 2


def test_qwen2_audio_through_an_encoder_server_and_fallback_fail(fleet, dead_url, qwen2_audio_server):
    """Audio clips equal the shared single server's; under --encoder-fallback fail, a clip no
    encoder server takes (over the encoder's byte bound) fails its request alone with a 503
    naming each server (the dead one too), while other requests are served."""
    encoder, language, encoder_url = fleet.audio_encoder, fleet.audio_language, fleet.audio_encoder_url
    short = [input_audio(encode(make_clip(seconds, seed), "WAV"), "wav") for seconds, seed in ((1.0, 30), (2.0, 31))]
    remote_before = encoder_forwards(encoder)
    for content in ([short[0], text("What do you hear?")], [*short, text("Compare.")]):
        messages = [{"role": "user", "content": content}]
        assert greedy(language, messages) == greedy(qwen2_audio_server, messages)
    assert wait_for_forwards(encoder, remote_before + 2) == remote_before + 2
    # 6 s of 16 kHz PCM is ~190 kB: over the encoder's bound, within the language server's.
    long_clip = input_audio(encode(make_clip(6.0, 32), "WAV"), "wav")
    status, body = language.chat({"messages": [{"role": "user", "content": [long_clip, text("Hi")]}],
                                  "max_tokens": 2})
    assert status == 503, body
    message = body["error"]["message"]
    assert "--encoder-fallback fail" in message and dead_url in message and encoder_url in message
    assert "400" in message and set(body["error"]) == {"message", "type", "param", "code"}
    messages = [{"role": "user", "content": [short[1], text("Again?")]}]
    assert greedy(language, messages) == greedy(qwen2_audio_server, messages)
    status, body = language.chat({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})
    assert status == 200, body


# ---- the wire format ----------------------------------------------------------------------

# pickletools' refusal of bytes that are not a pickle stream: an opcode it does not know, or
# the end of the bytes before a STOP.
NOT_A_PICKLE = r"opcode b'.*' unknown|pickle exhausted before seeing STOP"
PICKLE_MARKERS = (b"\x80\x02", b"\x80\x03", b"\x80\x04\x95", b"\x80\x05\x95", b"torch._utils", b"_rebuild_tensor",
                  b"cnumpy", b"PK\x03\x04")


def parse_as_documented(body: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """docs/encoder-wire-format.md, independently of vlmd: u64 LE header length, JSON, data."""
    (length,) = struct.unpack_from("<Q", body)
    header = json.loads(body[8 : 8 + length])
    data = body[8 + length :]
    metadata = header.pop("__metadata__")
    tensors = {}
    for name, entry in header.items():
        assert entry["dtype"] == "F32"
        begin, end = entry["data_offsets"]
        tensors[name] = np.frombuffer(data[begin:end], dtype="<f4").reshape(entry["shape"])
    assert sum(t.nbytes for t in tensors.values()) == len(data)
    return metadata, tensors


def post_items(server: Server, body: dict) -> tuple[int, bytes, str]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(server.url + "/v1/encoder_outputs", data=orjson.dumps(body), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read(), response.headers["Content-Type"]
    except urllib.error.HTTPError as error:
        return error.code, error.read(), error.headers["Content-Type"]


def test_the_wire_format_is_documented_safetensors_without_pickle(encoder_server):
    image = image_data_url(random_image(10))
    parts = [{"type": "image_url", "image_url": {"url": image}}, {"type": "image_url", "image_url": image},
             {"type": "image_url", "image_url": {"url": image_data_url(random_image(11))}}]
    status, body, content_type = post_items(encoder_server, {"model": "tiny", "items": parts})
    assert status == 200, body[:300]
    assert content_type.startswith("application/vnd.vlmd.encoder-outputs+safetensors")
    metadata, tensors = parse_as_documented(body)  # every data byte belongs to a float tensor
    (length,) = struct.unpack_from("<Q", body)
    assert not any(marker in body[: 8 + length] for marker in PICKLE_MARKERS)
    with pytest.raises(ValueError, match=NOT_A_PICKLE):  # the pickle parser's own refusal, no PROTO or STOP
        list(pickletools.genops(body))
    assert metadata["format"] == FORMAT and metadata["model"] == "tiny"
    assert len(tensors) == 2  # one per distinct item
    for name, tensor in tensors.items():
        assert re.fullmatch(r"[0-9a-f]{64}", name) and metadata[f"modality:{name}"] == "image"
        assert tensor.ndim == 2 and tensor.shape[0] > 0 and np.isfinite(tensor).all()
    # vlmd's own parser and the safetensors library read the same tensors.
    model, wire = unpack(body)
    assert model == "tiny" and set(wire) == set(tensors)
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    loaded = safetensors_numpy.load(body)
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(loaded[name], tensor)


def test_no_disaggregation_module_unpickles():
    for path in ("vlmd/encoder_wire.py", "vlmd/processing/encoder_tensors.py", "vlmd/processing/remote_encoder.py",
                 "vlmd/server/encoder_route.py"):
        source = (REPO / path).read_text()
        assert not re.search(r"import (c?pickle|dill|joblib)|pickle\.loads?\(|torch\.load\(|np\.load\(|"
                             r"numpy\.load\(|allow_pickle|Unpickler", source), path


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"not json", 400, None),
        ({"model": "tiny"}, 400, "items"),
        ({"model": "tiny", "items": []}, 400, "items"),
        ({"model": "tiny", "items": [{"type": "text", "text": "hi"}]}, 400, "items"),
        ({"model": "tiny", "items": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
         400, None),
        ({"model": "tiny", "items": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]},
         400, "messages"),
        ({"model": "tiny", "items": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}, 400, None),
        ({"model": "tiny", "items": [{"type": "image_url", "image_url": {"url": "x"}}] * 4}, 400, None),
        ({"model": "tiny", "items": [], "stream": True}, 400, "stream"),
        ({"model": "tiny", "items": [], "mm_processor_kwargs": 3}, 400, "mm_processor_kwargs"),
        ({"model": "other", "items": []}, 404, "model"),
    ],
)
def test_bad_input_to_the_encoder_route_is_an_openai_shaped_4xx(encoder_server, body, status, param):
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    code, answer = encoder_server.request("POST", "/v1/encoder_outputs", raw)
    assert code == status, answer
    error = orjson.loads(answer)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


def test_an_encoder_server_serves_no_generation(encoder_server):
    code, answer = encoder_server.request("POST", "/v1/chat/completions", orjson.dumps({"model": "tiny"}))
    assert code == 404 and "no route" in orjson.loads(answer)["error"]["message"]


def _body(header: dict, data: bytes = b"") -> bytes:
    text = orjson.dumps(header)
    return struct.pack("<Q", len(text)) + text + data


ID = "ab" * 32


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"\x01\x02", "shorter than its 8-byte header length"),
        (struct.pack("<Q", 1 << 40) + b"{}", "does not fit the body"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (_body({"__metadata__": {"format": "other"}}), "__metadata__.format"),
        (_body({"__metadata__": {"format": FORMAT, f"modality:{'x' * 64}": "image"},
                "x" * 64: {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}}, b"\0" * 4), "not an item identifier"),
        (_body({"__metadata__": {"format": FORMAT, f"modality:{ID}": "image"},
                ID: {"dtype": "I64", "shape": [1, 1], "data_offsets": [0, 8]}}, b"\0" * 8), "expected one of"),
        (_body({"__metadata__": {"format": FORMAT, f"modality:{ID}": "image"},
                ID: {"dtype": "F32", "shape": [2, 1], "data_offsets": [0, 4]}}, b"\0" * 4), "4 bytes for shape"),
        (_body({"__metadata__": {"format": FORMAT, f"modality:{ID}": "image"},
                ID: {"dtype": "F32", "shape": [1, 1], "data_offsets": [4, 8]}}, b"\0" * 8), "do not tile"),
        (_body({"__metadata__": {"format": FORMAT, f"modality:{ID}": "image"},
                ID: {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}}, b"\0" * 9), "belong to no tensor"),
        (_body({"__metadata__": {"format": FORMAT},
                ID: {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}}, b"\0" * 4), "no modality"),
    ],
)
def test_the_parser_refuses_what_is_not_the_format(body, fragment):
    from vlmd.encoder_wire import WireFormatError

    with pytest.raises(WireFormatError, match=re.escape(fragment)):
        unpack(body)
