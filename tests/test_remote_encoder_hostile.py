"""A remote encoder is an untrusted peer (issue 50, item 3): ``RemoteEncoders`` against a
hostile encoder server on 127.0.0.1 that answers the wrong width, the wrong number of rows,
NaN, a body dripped two bytes a second, headers dripped, or nothing at all.

Each is a failure of that server, counted by reason, answered by the local fallback (the
items keep no output: the runner encodes them) or, under ``--encoder-fallback fail``, a 503
naming the server; a good answer is attached. The exchange is bounded as a whole by
``--encoder-timeout-s``: a drip or a silence costs the thread the timeout, not the minute
the hostile server would hold it (the bound "under 10 s" stands for that hang).
"""

from __future__ import annotations

import collections
import threading
import time

import pytest

from vlmd.errors import ServiceUnavailableError
from vlmd.processing.chat import MediaRef
from vlmd.processing.remote_encoder import RemoteEncoders
from vlmd.testing.hostile_encoder import IDENTIFIER, TOKENS, WIDTH, HostileEncoder
from vlmd.types import MultiModalItem

MODEL = "tiny"
TIMEOUT_S = 1.0


class Counts:
    def __init__(self):
        self.failures: collections.Counter[str] = collections.Counter()

    def observe_encoder_server_failure(self, reason: str) -> None:
        self.failures[reason] += 1


@pytest.fixture
def hostile():
    server = HostileEncoder(MODEL)
    yield server
    server.close()


def _attach(hostile: HostileEncoder, mode: str, fallback: str = "local") -> tuple[int, MultiModalItem, Counts]:
    hostile.modes.append(mode)
    counts = Counts()
    encoders = RemoteEncoders((hostile.url,), MODEL, TIMEOUT_S, fallback, WIDTH, observer=counts)
    item = MultiModalItem("image", IDENTIFIER, offset=0, length=TOKENS)
    attached = encoders.attach([item], [MediaRef("image", "data:image/png;base64,AAAA")], None)
    return attached, item, counts


def test_a_good_answer_is_attached(hostile):
    attached, item, counts = _attach(hostile, "good")
    assert attached == 1 and not counts.failures
    assert tuple(item.encoder_output.shape) == (TOKENS, WIDTH) and float(item.encoder_output[0, 0]) == 0.5


@pytest.mark.parametrize("mode, fragment", [
    ("wide", f"shape [{TOKENS}, {WIDTH + 1}]; the item takes [{TOKENS}, {WIDTH}]"),
    ("narrow", f"shape [{TOKENS}, {WIDTH - 1}]"),
    ("rows", f"shape [{TOKENS + 1}, {WIDTH}]"),
    ("nan", "not finite"),
    ("inf", "not finite"),
    ("model", "serves the model 'other'"),
])
def test_an_answer_that_does_not_fit_falls_back_and_is_counted(hostile, mode, fragment):
    attached, item, counts = _attach(hostile, mode)
    assert attached == 0 and item.encoder_output is None  # the runner encodes it here
    assert counts.failures == {"invalid_answer": 1}
    hostile.modes.append(mode)
    with pytest.raises(ServiceUnavailableError, match="--encoder-fallback fail") as refused:
        _attach(hostile, mode, fallback="fail")
    assert fragment in refused.value.message


@pytest.mark.parametrize("mode", ["hang", "drip-body", "drip-headers"])
def test_a_silent_or_dripping_server_holds_the_thread_no_longer_than_the_timeout(hostile, mode):
    started = time.monotonic()
    attached, item, counts = _attach(hostile, mode)
    seconds = time.monotonic() - started
    assert attached == 0 and item.encoder_output is None
    assert counts.failures == {"timeout": 1}
    assert seconds < 10, seconds  # the server would hold it hostile_encoder.HANG_S (60 s)


def test_an_unreachable_server_is_counted_as_such():
    from conftest import free_port

    counts = Counts()
    encoders = RemoteEncoders((f"http://127.0.0.1:{free_port()}",), MODEL, TIMEOUT_S, "local", WIDTH, observer=counts)
    item = MultiModalItem("image", IDENTIFIER, offset=0, length=TOKENS)
    assert encoders.attach([item], [MediaRef("image", "data:,")], None) == 0
    assert counts.failures == {"unreachable": 1}


# ---- through the front door: a language server whose only encoder server is hostile ----

@pytest.fixture(scope="module")
def hostile_for_a_server(llava_encoder_server):
    server = HostileEncoder(MODEL, upstream=llava_encoder_server.url)
    yield server
    server.close()


@pytest.fixture(scope="module")
def language_server(tiny_llava_dir, hostile_for_a_server, tmp_path_factory):
    from conftest import Server

    server = Server(tiny_llava_dir, "--no-warmup", "--encoder-urls", hostile_for_a_server.url,
                    "--encoder-timeout-s", "2", "--preprocess-timeout", "30", "--preprocess-threads", "4",
                    log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def _image_chat(server, seed: int) -> tuple[int, dict]:
    from conftest import image_message, random_image

    return server.chat({"messages": image_message("Which colour?", random_image(seed, 64, 64)), "max_tokens": 2,
                        "temperature": 0, "return_token_ids": True})


def _failures(server) -> dict[str, float]:
    metrics = server.metrics()
    return {reason: metrics.get(f'vlmd_encoder_server_failures_total{{reason="{reason}"}}', 0.0)
            for reason in ("invalid_answer", "timeout")}


def test_every_request_is_answered_by_the_local_encoder_beside_a_hostile_one(language_server, hostile_for_a_server):
    server, hostile = language_server, hostile_for_a_server
    before = _failures(server)
    local_before = server.metrics()["vlmd_encoder_forwards_total"]
    hostile.modes.append("proxy-good")  # the proxy itself is sound: an honest answer is used
    status, honest = _image_chat(server, 39)
    assert status == 200, honest
    assert server.metrics()["vlmd_encoder_forwards_total"] == local_before
    for seed, mode in enumerate(("proxy-wide", "proxy-nan", "proxy-rows"), start=40):
        hostile.modes.append(mode)
        status, body = _image_chat(server, seed)  # a new image each: none is resident yet
        assert status == 200, (mode, body)
    assert _failures(server)["invalid_answer"] - before["invalid_answer"] == 3
    assert server.metrics()["vlmd_encoder_forwards_total"] - local_before == 3  # encoded here instead
    # Four requests meet a drip or a silence; a plain chat beside them is answered, and so
    # is each of them (by the local encoder, once the timeout has passed).
    hostile.modes.extend(["drip-body", "hang", "drip-headers", "hang"])
    results: dict[int, tuple[int, dict]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _image_chat(server, 50 + i)))
               for i in range(4)]
    for thread in threads:
        thread.start()
    status, body = server.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200, body
    for thread in threads:
        thread.join(60)
    assert [results[i][0] for i in range(4)] == [200] * 4, results
    assert _failures(server)["timeout"] - before["timeout"] == 4
