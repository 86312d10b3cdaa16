"""Constraint compiles bounded in time and number (issue 36 item 1): the queue alone, and the
front end's wait on it, driven by a compile that blocks until the test releases it."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from vlmd.errors import BadRequestError, ServiceUnavailableError
from vlmd.server.structured_output import compile_structured_output
from vlmd.structured.compile_queue import CompileQueue


@dataclass(frozen=True)
class Spec:
    source: str
    kind: str = "regex"
    param: str = "structured_outputs"
    choices: tuple = ()


class BlockingCompile:
    """A compile that records its calls and returns only once ``release`` is set."""

    def __init__(self):
        self.release = threading.Event()
        self.started: list[str] = []

    def __call__(self, spec):
        self.started.append(spec.source)
        if not self.release.wait(timeout=30):
            raise RuntimeError("the test never released the compile")
        return f"compiled {spec.source}"


def test_one_constraint_compiles_once_for_all_its_waiters():
    compile_fn = BlockingCompile()
    queue = CompileQueue(compile_fn, timeout_s=5)
    first, second = queue.join(Spec("a+")), queue.join(Spec("a+"))
    assert first is second and queue.num_pending == 1
    compile_fn.release.set()
    assert first.result(timeout=10) == "compiled a+"
    queue.leave(Spec("a+"), first)
    queue.leave(Spec("a+"), second)
    assert compile_fn.started == ["a+"] and queue.num_pending == 0
    queue.shutdown()


def test_past_the_pending_bound_a_new_constraint_is_a_503():
    compile_fn = BlockingCompile()
    queue = CompileQueue(compile_fn, timeout_s=5, max_pending=2)
    held = [queue.join(Spec(text)) for text in ("a", "b")]
    with pytest.raises(ServiceUnavailableError, match="retry"):
        queue.join(Spec("c"))
    assert queue.join(Spec("a")) is held[0]  # one already compiling is still shared
    assert queue.num_refused == 1
    compile_fn.release.set()
    for future in held:
        future.result(timeout=10)
    queue.shutdown()


def test_a_compile_nobody_waits_for_any_more_is_cancelled_before_it_starts():
    compile_fn = BlockingCompile()
    queue = CompileQueue(compile_fn, timeout_s=5, threads=1)
    running = queue.join(Spec("first"))
    queued = queue.join(Spec("second"))  # behind "first" on the one thread
    queue.leave(Spec("second"), queued)
    assert queued.cancelled() and queue.num_cancelled == 1
    compile_fn.release.set()
    running.result(timeout=10)
    queue.leave(Spec("first"), running)
    assert compile_fn.started == ["first"] and queue.num_pending == 0
    queue.shutdown()


def _state(queue) -> SimpleNamespace:
    compiler = SimpleNamespace(cached=lambda spec: None)
    config = SimpleNamespace(max_structured_output_choices=10, max_structured_output_bytes=1000)
    return SimpleNamespace(grammar_compiler=compiler, grammar_queue=queue, config=config)


def test_a_request_waits_at_most_the_budget_then_gets_a_400_naming_the_flag():
    compile_fn = BlockingCompile()
    queue = CompileQueue(compile_fn, timeout_s=0.05)
    with pytest.raises(BadRequestError, match=r"--max-grammar-compile-s") as caught:
        asyncio.run(compile_structured_output(_state(queue), Spec("slow")))
    assert caught.value.status == 400 and queue.num_timeouts == 1
    # The compile was running, so it runs on (bounded by the library's fuel) and is cached by
    # the compiler; a request that asks again later shares or reuses it.
    compile_fn.release.set()
    queue.shutdown()


def test_a_request_gets_the_compiled_grammar_within_the_budget():
    compile_fn = BlockingCompile()
    compile_fn.release.set()
    queue = CompileQueue(compile_fn, timeout_s=10)
    assert asyncio.run(compile_structured_output(_state(queue), Spec("fast"))) == "compiled fast"
    assert queue.num_pending == 0
    queue.shutdown()
