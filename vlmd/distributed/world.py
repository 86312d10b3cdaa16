"""The ranks of one tensor-parallel model: where they meet, which cores each runs on.

Every rank is a process with one ``torch.distributed`` world of ``size`` ranks. The model's
collectives (the all-reduce after each row-parallel linear) run on the default group: gloo
on CPU, NCCL when the device is CUDA. The per-step control messages (channel.py) always run
on a gloo group over CPU tensors, so the scheduler's plain data never has to visit a GPU.
Ranks are laid out node by node: node ``n`` holds ranks ``[n * per_node, (n + 1) * per_node)``;
rank 0 (node 0) is the serving process itself.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class WorldSpec:
    """Plain data every rank process is started with (JSON on its command line)."""

    size: int
    nnodes: int
    master_addr: str
    master_port: int
    timeout_s: float
    device: str = "cpu"

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    def ranks_of_node(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class World:
    rank: int
    size: int
    control: object  # a gloo ProcessGroup for the step channel
    backend: str


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


# Loading a shard can take minutes and ranks finish at different times: until every rank
# has acked the start-up plan, collectives wait this long; then ``serving_timeouts`` brings
# them down to ``--distributed-timeout-s``.
STARTUP_TIMEOUT_S = 600.0


def init_world(spec: WorldSpec, rank: int) -> World:
    """Join the world (blocks until every rank has joined or the start-up timeout passes)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=max(spec.timeout_s, STARTUP_TIMEOUT_S))
    backend = backend_for(spec.device)
    dist.init_process_group(
        backend, init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
        rank=rank, world_size=spec.size, timeout=timeout,
    )
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return World(rank, spec.size, control, backend)


def serving_timeouts(world: World, timeout_s: float) -> None:
    """Every collective from now on fails after ``timeout_s`` (a rank that hangs is found)."""
    from torch.distributed import distributed_c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    distributed_c10d._set_pg_timeout(timeout)  # no public setter (torch 2.13): the default group
    if world.control is not distributed_c10d.group.WORLD:
        distributed_c10d._set_pg_timeout(timeout, world.control)


def leave_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host`` (the store binds it a moment later; a race is a start-up error)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cores_for(local_index: int, local_ranks: int, threads: int | None) -> tuple[list[int], int]:
    """(cores, torch threads) of one of this host's ranks: consecutive cores, ``threads`` each.

    Without ``--torch-threads`` the host's cores are divided evenly (at least one each);
    with more ranks than cores the cores wrap around (oversubscribed, but still bound).
    """
    available = sorted(os.sched_getaffinity(0))
    count = threads or max(1, len(available) // local_ranks)
    start = local_index * count
    return [available[(start + i) % len(available)] for i in range(count)], count


def bind_thread(cores: list[int], native_thread_id: int = 0) -> None:
    """Pin one thread (0: the caller) to ``cores``; threads it starts later inherit the mask."""
    os.sched_setaffinity(native_thread_id, cores)
