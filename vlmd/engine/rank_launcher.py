"""Starting, watching and ending this host's tensor-parallel rank processes.

``vlmd serve --tensor-parallel-size N`` starts ranks 1..per_node-1 of node 0 beside itself
(rank 0 is the serving process); ``vlmd serve --nnodes M --node-rank K`` (K > 0) starts
node K's ranks and only supervises them, with no HTTP. Each rank is ``python -m
vlmd.engine.rank_process SPEC`` (a fresh interpreter, as multiprocessing's 'spawn' would
give, but visible as itself in ``ps`` and with its own exit code); it inherits stdout and
stderr, so its log lines (JSON, with ``rank``) land in the server's log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

import structlog

from vlmd.distributed.world import WorldSpec, bind_thread

log = structlog.get_logger(__name__)


@dataclass
class RankSpec:
    """Everything one rank process needs: plain data, JSON on its command line."""

    world: dict  # WorldSpec.to_dict()
    rank: int
    local_index: int
    local_ranks: int
    model_dir: str
    dtype: str
    torch_threads: int | None
    log_level: str = "info"
    # --linear-kernels and --attention-kernels, as rank 0 took them.
    linear_kernels: str = "auto"
    attention_kernels: str = "auto"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RankSpec":
        return cls(**json.loads(text))

    @property
    def world_spec(self) -> WorldSpec:
        return WorldSpec(**self.world)


def rank_command(spec: RankSpec) -> list[str]:
    """A rank's command line: a fresh interpreter running ``rank_process`` on ``spec``."""
    return [sys.executable, "-m", "vlmd.engine.rank_process", spec.to_json()]


class RankProcesses:
    """This host's rank processes (not rank 0's own)."""

    def __init__(self, specs: list[RankSpec]):
        self.specs = specs
        self.procs: list[tuple[int, subprocess.Popen]] = []
        self._startup_done = threading.Event()

    def start(self, mask: set[int] | None = None) -> None:
        """``mask``: the cores the ranks start under (they pick their own share from it), when
        the calling thread is pinned to fewer: a child inherits its parent thread's mask."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        pinned = os.sched_getaffinity(0) if mask is not None else None
        if mask is not None:
            bind_thread(sorted(mask))
        try:
            for spec in self.specs:
                self.procs.append((spec.rank, subprocess.Popen(rank_command(spec), env=env)))
        finally:
            if pinned is not None:
                bind_thread(sorted(pinned))
        log.info("tensor-parallel ranks started", ranks=[rank for rank, _ in self.procs],
                 pids=[proc.pid for _, proc in self.procs])

    def guard_startup(self) -> None:
        """Until :meth:`started`, a rank that exits ends this process at once: start-up waits
        (the rendezvous, loading) would otherwise sit out the whole timeout."""

        def guard() -> None:
            while not self._startup_done.wait(0.2):
                dead = self.first_exited()
                if dead is not None:
                    log.error("tensor-parallel start-up failed", reason=dead)
                    self.stop(grace_s=2.0)
                    os._exit(1)

        threading.Thread(target=guard, name="vlmd-tp-startup-guard", daemon=True).start()

    def started(self) -> None:
        self._startup_done.set()

    def first_exited(self) -> str | None:
        for rank, proc in self.procs:
            code = proc.poll()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"code {code}"
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with {how}"
        return None

    def wait_all(self) -> int:
        """Supervise until every rank has exited; the first failure ends the others."""
        while True:
            codes = [proc.poll() for _, proc in self.procs]
            if all(code is not None for code in codes):
                return next((code for code in codes if code), 0)
            dead = self.first_exited()
            if dead is not None and any(code not in (None, 0) for code in codes):
                log.error("a tensor-parallel rank failed; ending this node's ranks", reason=dead)
                self.stop(grace_s=5.0)
                return 1
            time.sleep(0.2)

    def stop(self, grace_s: float = 10.0) -> None:
        """Wait for ranks told to shut down; terminate, then kill, the ones still running."""
        deadline = time.monotonic() + grace_s
        for _, proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
        for _, proc in self.procs:
            try:
                proc.wait(3.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def local_rank_specs(world: WorldSpec, node: int, model_dir: str, dtype: str, torch_threads: int | None,
                     log_level: str, skip_rank_zero: bool, linear_kernels: str = "auto",
                     attention_kernels: str = "auto") -> list[RankSpec]:
    ranks = world.ranks_of_node(node)
    return [
        RankSpec(world.to_dict(), rank, index, len(ranks), model_dir, dtype, torch_threads, log_level,
                 linear_kernels, attention_kernels)
        for index, rank in enumerate(ranks)
        if not (skip_rank_zero and rank == 0)
    ]


def run_node(world: WorldSpec, node: int, model_dir: str, dtype: str, torch_threads: int | None,
             log_level: str, linear_kernels: str = "auto", attention_kernels: str = "auto") -> int:
    """A node other than 0: run its ranks, no HTTP; returns the exit code."""
    processes = RankProcesses(local_rank_specs(world, node, model_dir, dtype, torch_threads, log_level, False,
                                               linear_kernels, attention_kernels))

    def terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    processes.start()
    log.info("node running ranks only (no HTTP)", node=node, ranks=list(world.ranks_of_node(node)),
             master=f"{world.master_addr}:{world.master_port}")
    try:
        code = processes.wait_all()
    except KeyboardInterrupt:
        processes.stop(grace_s=0.0)
        return 0
    log.info("node's ranks ended", node=node, code=code)
    return code
