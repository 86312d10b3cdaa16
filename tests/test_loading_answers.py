"""While the model loads, the server answers (issue 50, item 5): ``/health`` is a prompt 503
"loading" (a readiness probe sees not-ready), and ``/v1/*`` a 503 with ``Retry-After``,
instead of each request waiting in the listen backlog until the load is done.

The load is held by the test-only fault ``load_waits_for`` (vlmd/testing/faults.py: loading
waits until a file exists), so the test is bound by states: while the file is missing the
server can only answer "loading" or not at all, and a request that waits for the load
never gets its answer (the client's timeout fails the test); once the file exists the
server becomes ready and the same requests succeed.
"""

from __future__ import annotations

import socket
import time

import orjson
import pytest
from conftest import Server, assert_error


@pytest.fixture
def held_server(tiny_llava_dir, tmp_path):
    release = tmp_path / "release-the-load"
    server = Server(tiny_llava_dir, "--no-warmup", faults={"load_waits_for": str(release)}, log_dir=tmp_path,
                    wait_until_healthy=False)
    server.release = release
    yield server
    server.stop()


def _wait_listening(server: Server, timeout_s: float = 120.0) -> None:
    """Until the port accepts (the process imports first; that is not the load)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited early:\n{server.log_path.read_text()[-4000:]}")
        try:
            socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the server never listened")


def test_health_and_the_api_answer_503_loading_until_the_model_is_loaded(held_server):
    server = held_server
    _wait_listening(server)
    chat = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for _ in range(3):  # every time, not once
        status, raw = server.request("GET", "/health", timeout=30)
        assert_error(status, raw, 503, "loading", param=None)
        status, raw = server.request("POST", "/v1/chat/completions", chat, timeout=30)
        assert_error(status, raw, 503, "loading", "retry later", param=None)
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(server.url + "/v1/models", timeout=30)
    assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "5"
    assert server.process.poll() is None
    server.release.touch()
    server.wait_healthy()
    status, raw = server.request("POST", "/v1/chat/completions", chat, timeout=120)
    assert status == 200, raw
    status, raw = server.request("GET", "/health")
    assert (status, raw) == (200, b"")
