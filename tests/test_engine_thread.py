"""The engine thread runs what it is given in order; the media pool's torch ops start no
OpenMP team (engine_thread.py says why a second team slows every engine step)."""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from vlmd.engine.engine_thread import EngineThread, single_threaded_torch


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_op() -> float:
    x = torch.ones(1 << 21)  # far above ATen's grain size: split over the thread's team
    return float((x * 2).sum())


def test_calls_run_in_order_on_one_thread_and_raise_to_the_caller():
    thread = EngineThread(name="test-engine")
    try:
        seen = []
        futures = [thread.submit(lambda i=i: seen.append((i, threading.current_thread().name))) for i in range(5)]
        for future in futures:
            future.result(timeout=10)
        assert [i for i, _ in seen] == list(range(5))
        assert {name for _, name in seen} == {"test-engine"}
        assert thread.call(lambda: 41 + 1) == 42
        with pytest.raises(ZeroDivisionError):
            thread.call(lambda: 1 / 0)
        assert thread.call(lambda: "still serving") == "still serving"
    finally:
        thread.close(timeout=10)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_pool_threads_start_no_openmp_team():
    # It counts the process's threads, which earlier tests' engine threads (and their
    # OpenMP teams, which libgomp keeps) also are: it failed after test_failure_isolation
    # in one process. So the check runs in a fresh interpreter.
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    script = f"import sys; sys.path.insert(0, {here!r}); import test_engine_thread; test_engine_thread.check_pool_threads()"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def check_pool_threads():
    threads = torch.get_num_threads()
    engine = EngineThread(name="test-engine-omp")
    try:
        before = _os_threads()

        def engine_work():
            torch.set_num_threads(2)
            return _parallel_op()

        engine.call(engine_work)
        # The engine thread, and its team's one other thread, which lives on.
        assert _os_threads() - before == 2
        started = _os_threads()
        with ThreadPoolExecutor(1, initializer=single_threaded_torch) as pool:
            assert pool.submit(_parallel_op).result(timeout=30) == 2.0 * (1 << 21)
            assert _os_threads() - started == 1, "a pool thread with a team of its own"
            assert engine.call(torch.get_num_threads) == 2, "the engine thread keeps its count"
    finally:
        engine.close(timeout=10)
        torch.set_num_threads(threads)  # also the default of threads not started yet


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_numpy_starts_no_openblas_pool_under_the_cli():
    # The CLI module sets OpenBLAS to one thread before numpy loads it; on a host with more
    # than one CPU, numpy's own default starts a pool of spinning threads at import.
    import subprocess
    import sys

    script = (
        "import os, vlmd.cli\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "import numpy\n"
        "numpy.ones((512, 512)) @ numpy.ones((512, 512))\n"
        "print(before, len(os.listdir('/proc/self/task')), os.environ.get('OPENBLAS_NUM_THREADS', 'unset'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    before, after, setting = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()
    assert setting == "1"
    assert after == before, "numpy started threads of its own"
