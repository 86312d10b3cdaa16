"""The runner's one device, and how much memory it has and has used.

``--device auto`` is CUDA when torch sees a GPU, else the CPU. Memory is measured the way
each device allows:
- CUDA: the caching allocator's own figures (``max_memory_allocated`` after a reset), and
  ``mem_get_info`` for the card's total and what other processes hold;
- CPU: the process's resident set. Linux keeps a high-water mark (``VmHWM`` in
  /proc/self/status) that writing "5" to /proc/self/clear_refs resets to the current RSS,
  so a peak is measured exactly, however short it was. Where that reset is refused, a
  thread samples the RSS every millisecond instead (a peak shorter than that can be missed,
  and the plan says which method measured it).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch


def resolve_device(name: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> a torch.device that exists here."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise ValueError(f"--device {name} is not supported (auto, cpu, cuda, cuda:N)")
    return device


def cuda_index_to_make_current(device: torch.device, current_index: int) -> int | None:
    """The CUDA device a thread that runs on ``device`` must make current (``current_index``
    is current now), or None when there is nothing to set: a CPU device, plain ``cuda`` (the
    current one), or ``cuda:N`` already current."""
    if device.type != "cuda" or device.index is None or device.index == current_index:
        return None
    return device.index


def make_current_on_this_thread(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device; a no-op on the CPU.

    What names no device goes to the current one (the host staging's ``torch.cuda.Event``
    records on the current stream), and CUDA keeps the current device per host thread: so the
    thread that builds and steps the runner sets it, else ``--device cuda:1`` would order its
    copies on cuda:0's stream."""
    if device.type != "cuda":
        return  # before any torch.cuda call: a CPU build of torch has no CUDA to ask
    index = cuda_index_to_make_current(device, torch.cuda.current_device())
    if index is not None:
        torch.cuda.set_device(index)


class DeviceMemory:
    """Total, current and peak memory of one device, for the start-up memory plan."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sampler: _RssSampler | None = None
        self.method = "cuda allocator" if device.type == "cuda" else "VmHWM"

    def total_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[1]
        return host_memory_bytes()

    def used_bytes(self) -> int:
        """CUDA: everything on the card (other processes and the CUDA context included);
        CPU: this process's resident set."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return total - free
        return _status_kib("VmRSS") * 1024

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "RSS sampled every 1 ms"
            self._sampler = _RssSampler()

    def peak_bytes(self) -> int:
        """CUDA: the allocator's peak since the reset; CPU: the peak resident set since it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        if self._sampler is not None:
            peak, self._sampler = self._sampler.stop(), None
            return peak
        return _status_kib("VmHWM") * 1024

    def current_bytes(self) -> int:
        """What the peak is measured against: CUDA allocated bytes, CPU resident set."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _status_kib("VmRSS") * 1024


def host_memory_bytes() -> int:
    """MemTotal, or the cgroup's memory limit when that is lower (a container)."""
    total = 0
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


class _RssSampler:
    def __init__(self) -> None:
        self.peak = _status_kib("VmRSS") * 1024
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlmd-rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as handle:
            while not self._stop.is_set():
                handle.seek(0)
                self.peak = max(self.peak, int(handle.read().split()[1]) * page)
                time.sleep(0.001)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak
