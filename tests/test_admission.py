"""Torch-free units of the reliability layer: the error vocabulary, the media budget, the
preprocessing deadline and admission, and the scheduler's rollback after a failed step."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from types import SimpleNamespace

import pytest

from sched_support import image, make_request, make_scheduler
from vlmd.errors import (BadRequestError, PayloadTooLargeError, RequestRejected, ServerError, ServiceUnavailableError,
                         as_client_error, from_engine)
from vlmd.media.budget import MediaBudget
from vlmd.processing.deadline import Deadline, PreprocessTimeout
from vlmd.server.admission import Admission


# --- errors -------------------------------------------------------------------------------


def test_engine_errors_map_to_one_status_each():
    assert isinstance(from_engine("too long", 400, "r1"), BadRequestError)
    error = from_engine("boom", 500, "r1")
    assert isinstance(error, ServerError) and error.status == 500 and "request id r1" in error.message
    assert from_engine(None, None, "r2").status == 500


def test_unknown_exceptions_become_server_errors_without_internals():
    error = as_client_error(KeyError("secret internals"), "err-1")
    assert error.status == 500 and "secret" not in error.message and "err-1" in error.message
    mine = BadRequestError("bad")
    assert as_client_error(mine) is mine


def test_overload_carries_retry_after():
    assert ServiceUnavailableError("full", retry_after_s=3).headers == {"Retry-After": "3"}
    assert BadRequestError("x").headers == {}


def test_scheduler_limits_are_client_errors():
    scheduler = make_scheduler(max_model_len=32)
    with pytest.raises(RequestRejected) as info:
        scheduler.add_request(make_request("long", 40))
    assert info.value.status == 400 and isinstance(info.value, ValueError)


# --- media budget ---------------------------------------------------------------------------


def test_media_budget_413_503_and_release():
    budget = MediaBudget(1000)
    first, second = budget.lease(), budget.lease()
    with pytest.raises(PayloadTooLargeError, match="1001 bytes"):
        first.hold(1001, "image 0")
    first.hold(600, "image 0")
    with pytest.raises(ServiceUnavailableError, match="retry later"):
        second.hold(500, "image 0")
    first.settle(100)  # processed inputs are smaller than the decoded image
    second.hold(500, "image 0")
    assert budget.used_bytes == 600
    first.release()
    first.release()  # idempotent
    with second:
        pass
    assert budget.used_bytes == 0


# --- deadline and admission -------------------------------------------------------------------


def test_deadline_runs_from_start_and_can_be_abandoned():
    deadline = Deadline(0.05)
    deadline.check("queued")  # not started: never late
    deadline.start()
    deadline.check("tokenizing")
    time.sleep(0.06)
    with pytest.raises(PreprocessTimeout, match="abandoned before tokenizing"):
        deadline.check("tokenizing")
    other = Deadline(100)
    other.start()
    other.abandon()
    assert other.expired


def make_admission(pool, *, threads=1, max_queue=1, max_waiting=10, timeout_s=0.2, num_waiting=0):
    engine = SimpleNamespace(num_waiting=num_waiting)
    return Admission(pool, engine, threads=threads, max_queue=max_queue, max_waiting=max_waiting,
                     timeout_s=timeout_s, media_budget_bytes=2**20)


def test_slow_preprocessing_is_answered_at_the_deadline_and_abandoned_between_stages():
    stages: list[str] = []
    finished = threading.Event()

    def work(deadline):
        try:
            for stage in ("template", "tokenize", "decode", "process"):
                deadline.check(stage)
                stages.append(stage)
                time.sleep(0.15)
        finally:
            finished.set()

    async def main():
        with ThreadPoolExecutor(1) as pool:
            admission = make_admission(pool, timeout_s=0.2)
            began = time.monotonic()
            with pytest.raises(PreprocessTimeout):
                await admission.preprocess(work)
            answered = time.monotonic() - began
            assert finished.wait(2)
            await asyncio.sleep(0.05)  # the done callback runs on the loop
            return answered, admission

    answered, admission = asyncio.run(main())
    assert answered < 0.5
    assert stages == ["template", "tokenize"]  # abandoned at the next boundary, not run to the end
    assert admission.num_timeouts == 1 and admission.num_preprocessing == 0


def test_the_queue_and_waiting_bounds_answer_503():
    release = threading.Event()

    async def main():
        with ThreadPoolExecutor(1) as pool:
            admission = make_admission(pool, threads=1, max_queue=1, timeout_s=5)
            first = asyncio.ensure_future(admission.preprocess(lambda d: release.wait(5)))
            second = asyncio.ensure_future(admission.preprocess(lambda d: release.wait(5)))
            await asyncio.sleep(0.05)
            with pytest.raises(ServiceUnavailableError, match="--max-preprocess-queue"):
                await admission.preprocess(lambda d: None)
            release.set()
            await asyncio.gather(first, second)
            full = make_admission(pool, max_waiting=3, num_waiting=3)
            with pytest.raises(ServiceUnavailableError, match="--max-waiting-requests 3"):
                full.check_capacity()
            make_admission(pool, max_waiting=3, num_waiting=2).check_capacity()

    asyncio.run(main())


def test_media_work_leaves_one_thread_to_work_without_media():
    """Two threads: media work holds at most one, so a second image request waits for it while
    a text request is served at once (D110); with one thread, everything shares it."""
    release = threading.Event()
    started: list[str] = []

    def blocking(name):
        def work(deadline):
            started.append(name)
            release.wait(5)
            return name
        return work

    async def main():
        with ThreadPoolExecutor(2) as pool:
            admission = make_admission(pool, threads=2, max_queue=4, timeout_s=5)
            first = asyncio.ensure_future(admission.preprocess(blocking("image 1")))
            second = asyncio.ensure_future(admission.preprocess(blocking("image 2")))
            await asyncio.sleep(0.05)
            assert started == ["image 1"]
            assert await asyncio.wait_for(admission.preprocess(lambda d: "text", media=False), 2) == "text"
            assert started == ["image 1"] and admission.num_preprocessing == 2
            second.cancel()  # a client that leaves while it waits for a media thread
            await asyncio.gather(second, return_exceptions=True)
            assert admission.num_preprocessing == 1
            release.set()
            assert await asyncio.wait_for(first, 2) == "image 1"
            await asyncio.sleep(0.05)
            assert admission.num_preprocessing == 0
            release.clear()
            third = asyncio.ensure_future(admission.preprocess(blocking("image 3")))
            await asyncio.sleep(0.05)
            assert started == ["image 1", "image 3"]  # the slot came back
            release.set()
            assert await asyncio.wait_for(third, 2) == "image 3"

    asyncio.run(main())
    with ThreadPoolExecutor(1) as pool:
        assert make_admission(pool, threads=1).media_threads == 1


# --- scheduler rollback after a failed step ------------------------------------------------------


def test_failing_a_request_frees_it_and_unregisters_its_unwritten_blocks():
    scheduler = make_scheduler(num_kv_blocks=64, enable_prefix_caching=True)
    scheduler.add_request(make_request("culprit", 16))
    out = scheduler.schedule()
    blocks = list(scheduler.kv.tables("culprit")[0])
    hashes = list(scheduler.requests["culprit"].block_hashes)
    assert any(scheduler.kv.pool.lookup((0, h)) in blocks for h in hashes)  # registered at allocation
    tainted = scheduler.fail_requests({"culprit": "boom"}, out.num_scheduled_tokens)
    assert tainted == [] and not scheduler.has_work()
    assert all(scheduler.kv.pool.lookup((0, h)) is None for h in hashes)  # never computed: not findable
    assert scheduler.kv.num_free_blocks == 64
    assert "culprit" in scheduler.schedule().dropped_request_ids


def test_a_request_that_adopted_a_culprits_blocks_in_the_same_step_recomputes():
    scheduler = make_scheduler(num_kv_blocks=64, enable_prefix_caching=True)
    scheduler.add_request(make_request("culprit", 16))
    scheduler.add_request(make_request("twin", 18))  # same first 16 tokens
    out = scheduler.schedule()
    assert scheduler.requests["twin"].num_computed_tokens - out.num_scheduled_tokens["twin"] > 0  # a prefix hit
    tainted = scheduler.fail_requests({"culprit": "boom"}, out.num_scheduled_tokens)
    assert tainted == ["twin"]
    twin = scheduler.requests["twin"]
    assert twin.num_computed_tokens == 0 and scheduler.waiting[0] is twin
    again = scheduler.schedule()
    assert again.num_scheduled_tokens["twin"] == 18  # from scratch: nothing was findable


def test_an_output_that_was_never_computed_is_forgotten():
    scheduler = make_scheduler(enable_prefix_caching=False)
    scheduler.add_request(make_request("culprit", 20, items=(image("img", 2, 8),)))
    out = scheduler.schedule()
    assert out.scheduled_encoder_inputs == {"culprit": [0]}
    scheduler.fail_requests({"culprit": "boom"}, out.num_scheduled_tokens)
    scheduler.forget_encoder_outputs({"img"})
    cache = scheduler.encoder_cache
    assert not cache.is_resident("img")
    assert cache.num_free_slots == cache.num_freeable_slots == cache.cache_size
    scheduler.add_request(make_request("next", 20, items=(image("img", 2, 8),)))
    out = scheduler.schedule()
    assert out.scheduled_encoder_inputs == {"next": [0]}  # encoded again, not taken for resident
    assert "img" in out.evicted_encoder_identifiers


def _body_admission(pool, max_body_bytes: int = 100, max_waiting: int = 10) -> Admission:
    return Admission(pool, SimpleNamespace(num_waiting=0), threads=1, max_queue=1, max_waiting=max_waiting,
                     timeout_s=1, media_budget_bytes=1, max_body_bytes=max_body_bytes)


def test_bodies_being_read_at_once_are_bounded_by_the_bytes_they_received():
    with ThreadPoolExecutor(1) as pool:
        admission = _body_admission(pool)
        with ExitStack() as bodies:
            for _ in range(4):  # 4 x the largest body, received whole: still admitted
                bodies.enter_context(admission.reading_body(100, 100, "--max-request-bytes")).received(100)
            assert admission.body_bytes == 400
            with admission.reading_body(1, 100, "--max-request-bytes") as fifth:
                with pytest.raises(ServiceUnavailableError, match="4 x --max-request-bytes"):
                    fifth.received(1)
                assert fifth.charged == 0
            assert admission.num_rejected == 1
        assert (admission.body_bytes, admission.num_reading) == (0, 0)
        with admission.reading_body(None, 100, "--max-request-bytes") as alone:  # no Content-Length: by its bytes
            alone.received(60)
            alone.received(90)
            assert admission.body_bytes == 90
        assert admission.body_bytes == 0


def test_a_body_alone_is_admitted_even_past_the_budget():
    """A route's bound may pass the budget (the audio form: max_audio_bytes + 1 MiB beside a
    small --max-request-bytes): alone, such a body is read; beside another, it waits its turn."""
    with ThreadPoolExecutor(1) as pool:
        admission = _body_admission(pool)  # budget 400
        with admission.reading_body(None, 1000, "the form") as alone:
            alone.received(300)
            alone.received(900)  # its own 300 are not "others"
            assert admission.body_bytes == 900
        with admission.reading_body(None, 100, "--max-request-bytes") as small:
            small.received(1)
            with admission.reading_body(None, 1000, "the form") as large:
                with pytest.raises(ServiceUnavailableError, match="1 bytes of other request bodies"):
                    large.received(400)
        assert admission.body_bytes == 0


def test_bodies_declared_and_never_sent_hold_no_share_of_the_budget():
    with ThreadPoolExecutor(1) as pool:
        admission = _body_admission(pool)
        with ExitStack() as stalled:
            for _ in range(8):  # declared at the bound, nothing arrives: they cost nothing
                stalled.enter_context(admission.reading_body(100, 100, "--max-request-bytes"))
            assert admission.body_bytes == 0
            with admission.reading_body(100, 100, "--max-request-bytes") as good:
                good.received(100)
                assert admission.body_bytes == 100
            assert admission.num_reading == 8


def test_a_declared_length_past_the_bound_is_a_413_before_anything_is_taken():
    with ThreadPoolExecutor(1) as pool:
        admission = _body_admission(pool, max_waiting=1)
        with admission.reading_body(0, 100, "--max-request-bytes"):  # the door is full now
            with pytest.raises(PayloadTooLargeError) as refused:
                with admission.reading_body(2**30, 100, "--max-request-bytes"):
                    pass
            assert refused.value.message == ("the request body declares 1073741824 bytes (Content-Length); the "
                                             "limit is 100 bytes (--max-request-bytes)")
            assert (admission.num_reading, admission.body_bytes, admission.num_rejected) == (1, 0, 0)
            with pytest.raises(ServiceUnavailableError, match="--max-waiting-requests 1"):  # within the bound
                with admission.reading_body(100, 100, "--max-request-bytes"):
                    pass
        with admission.reading_body(100, 100, "--max-request-bytes") as account:
            account.received(100)  # exactly the bound
        with admission.reading_body(None, 100, "--max-request-bytes") as account:  # a stream past it: 413 there
            with pytest.raises(PayloadTooLargeError, match="larger than the limit of 100 bytes"):
                account.received(101)
        assert (admission.num_reading, admission.body_bytes) == (0, 0)


def test_worker_reports_an_engine_refusal_as_400_and_a_bug_as_500():
    from vlmd.engine.worker import AddRequest, EngineWorker

    def refuse(request):
        raise RequestRejected("a media item of 900 tokens exceeds the encoder budget of 576")

    def crash(request):
        raise KeyError("bug")

    for add_request, status in ((refuse, 400), (crash, 500)):
        core = SimpleNamespace(add_request=add_request, stats=lambda: None)
        worker = EngineWorker(core, post_deltas=lambda deltas: None)
        (delta,) = worker._handle(AddRequest(make_request("r", 4)))
        assert delta.error_status == status
        assert from_engine(delta.error, delta.error_status, "r").status == status


def test_the_body_scanner_steps_in_python_per_chunk_not_per_quote(monkeypatch):
    """A chunk of JSON structure (a quote every few bytes) is scanned at C speed: a step per
    quote in Python held the event loop ~250 ms for each 768 KB of a tools list (D110).
    Counted: the scanner's run boundaries per chunk, not per quote."""
    from vlmd.server.body import _RunScanner

    boundaries = 0
    boundary = _RunScanner._boundary

    def counting(self):
        nonlocal boundaries
        boundaries += 1
        boundary(self)

    monkeypatch.setattr(_RunScanner, "_boundary", counting)
    scanner = _RunScanner(100, "too long")
    chunk = b'{"type": "function", "name": "tool"}, ' * 10_000
    scanner.feed(chunk)
    scanner.feed(chunk)
    assert boundaries <= 6


def test_the_body_scanner_refuses_long_text_runs_but_never_data_urls():
    from vlmd.server.body import _RunScanner

    def scan(body: bytes, chunk: int) -> bool:
        scanner = _RunScanner(100, "too long")
        try:
            for start in range(0, len(body), chunk):
                scanner.feed(body[start:start + chunk])
        except BadRequestError:
            return True
        return False

    text = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * 500 + b'"}]}'
    media = b'{"url": "data:image/png;base64,' + b"Q" * 5000 + b'", "text": "' + b"b" * 90 + b'"}'
    upper = b'{"url": "DATA:image/png;base64,' + b"Q" * 5000 + b'"}'
    split = b'{"text": "' + b"c\\\"" * 400 + b'"}'  # escaped quotes only split runs: a miss, never a wrong refusal
    for chunk in (1, 3, 7, 64, 1000, 10**6):
        assert scan(text, chunk), chunk
        assert not scan(media, chunk), chunk
        assert not scan(upper, chunk), chunk
        assert not scan(split, chunk), chunk
