"""--device resolution, the CPU peak-memory probe, and the host-to-device staging walk.

The CUDA side of these (pinned buffers, allocator peaks) needs a GPU: contrib/device/check.sh.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vlmd.config import parse_device
from vlmd.runner.device import (
    DeviceMemory,
    cuda_index_to_make_current,
    host_memory_bytes,
    make_current_on_this_thread,
    resolve_device,
)
from vlmd.runner.host_staging import HostStaging


def test_device_names():
    assert [parse_device(name) for name in ("auto", "CPU", "cuda", "cuda:1")] == ["auto", "cpu", "cuda", "cuda:1"]
    for bad in ("tpu", "cuda:x", "gpu"):
        with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
            parse_device(bad)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="sees no CUDA device"):
        resolve_device("cuda:0")


def test_the_device_a_thread_makes_current():
    cuda = torch.device
    assert cuda_index_to_make_current(cuda("cuda", 1), current_index=0) == 1
    assert cuda_index_to_make_current(cuda("cuda", 0), current_index=1) == 0
    assert cuda_index_to_make_current(cuda("cuda", 1), current_index=1) is None  # already current
    assert cuda_index_to_make_current(cuda("cuda"), current_index=1) is None  # plain cuda: the current one
    assert cuda_index_to_make_current(cuda("cpu"), current_index=0) is None


def _fake_cuda(monkeypatch, current: int) -> list[tuple[int, str]]:
    """torch.cuda's current device, without a GPU: (index, thread name) of every set_device."""
    made_current = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda index: made_current.append((index, threading.current_thread().name)))
    return made_current


def test_making_a_device_current_asks_cuda_nothing_on_the_cpu(monkeypatch):
    def no_cuda(*args):
        raise AssertionError("a CPU runner asked torch.cuda")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    monkeypatch.setattr(torch.cuda, "set_device", no_cuda)
    make_current_on_this_thread(torch.device("cpu"))


def test_making_cuda_1_current_sets_it_once(monkeypatch):
    made_current = _fake_cuda(monkeypatch, current=0)
    make_current_on_this_thread(torch.device("cuda", 1))
    assert [index for index, _ in made_current] == [1]
    made_current.clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    make_current_on_this_thread(torch.device("cuda", 1))
    assert made_current == []


def test_the_engine_worker_makes_the_runner_s_device_current_on_its_thread(monkeypatch):
    """--device cuda:1: the thread that steps the runner (the engine worker's) makes cuda:1 current."""
    from vlmd.engine.worker import EngineWorker

    made_current = _fake_cuda(monkeypatch, current=0)
    core = SimpleNamespace(executor=SimpleNamespace(device=torch.device("cuda", 1)), stats=lambda: None,
                           has_work=lambda: False)
    worker = EngineWorker(core, post_deltas=lambda deltas: None)
    worker.start()
    worker.stop()
    assert made_current == [(1, "vlmd-engine")]


def test_cpu_peak_is_the_resident_set_high_water_mark():
    memory = DeviceMemory(torch.device("cpu"))
    assert 2**30 < memory.total_bytes() == host_memory_bytes()
    base = memory.current_bytes()
    memory.reset_peak()
    block = np.ones(200 * 2**20 // 8)  # 200 MiB, touched, then freed
    del block
    peak = memory.peak_bytes() - base
    assert 190 * 2**20 < peak < 400 * 2**20, (memory.method, peak)


@dataclass
class _Span:
    rows: torch.Tensor
    mask: torch.Tensor | None
    label: str


@dataclass
class _Meta:
    slots: torch.Tensor
    spans: list[_Span]
    count: int


def test_staging_moves_every_tensor_of_nested_metadata_and_nothing_else(monkeypatch):
    staging = HostStaging(torch.device("cpu"))
    meta = _Meta(torch.arange(4), [_Span(torch.zeros(2), None, "a"), _Span(torch.ones(3), torch.ones(1), "b")], 2)
    assert staging.to_device(meta) is meta  # the CPU device copies nothing
    moved = []
    staging.device = torch.device("cuda", 0)  # a device object needs no GPU; nothing reaches it here
    monkeypatch.setattr(HostStaging, "passthrough", property(lambda self: False))
    monkeypatch.setattr(HostStaging, "_copy", lambda self, path, tensor: moved.append(path) or tensor.clone())
    monkeypatch.setattr(torch.cuda, "Event", lambda: type("E", (), {"record": lambda s: None, "synchronize": lambda s: None})())
    out = staging.to_device(meta, "meta")
    assert moved == ["meta.slots", "meta.spans[0].rows", "meta.spans[1].rows", "meta.spans[1].mask"]
    assert out is not meta and out.spans[1].label == "b" and out.count == 2
    assert torch.equal(out.spans[1].rows, meta.spans[1].rows) and out.spans[0].mask is None
