"""Rank 0's side of a tensor-parallel start-up: ranks started, world joined, plan agreed.

Order (each step bounded): start this host's other ranks (they import torch and load their
shards meanwhile) → rank 0 loads its own shard → join the world → broadcast the
:class:`StartupPlan` (KV blocks per rank, which rank 0 sized from its shard) → every rank
acks → the :class:`MultiprocExecutor` takes over. Until then a rank that exits ends the
server at once (``RankProcesses.guard_startup``); a rank on another host that never
arrives ends it after ``--distributed-timeout-s``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import structlog

from vlmd.config import ServeConfig
from vlmd.distributed.world import WorldSpec, bind_thread, cores_for, free_port
from vlmd.engine.rank_launcher import RankProcesses, local_rank_specs

log = structlog.get_logger(__name__)


def world_spec_of(config: ServeConfig, device: str = "cpu") -> WorldSpec:
    port = config.master_port or free_port(config.master_addr)
    return WorldSpec(config.tensor_parallel_size, config.nnodes, config.master_addr, port,
                     config.distributed_timeout_s, device)


@dataclass
class RankZeroPin:
    """Rank 0's cores and threads on this host, and the process's mask from before the pin."""

    cores: list[int]
    threads: int
    process_mask: set[int]


@dataclass
class TensorParallelStart:
    world: WorldSpec
    processes: RankProcesses
    pin: RankZeroPin

    @property
    def tp(self):
        from vlmd.layers.linear import TPGroup

        return TPGroup(self.world.size, 0)

    def executor(self, runner, kv_cache, seed: int):
        from vlmd.distributed.channel import Kind, StepChannel
        from vlmd.distributed.world import init_world, serving_timeouts
        from vlmd.engine.multiproc_executor import MultiprocExecutor, StartupPlan

        world = init_world(self.world, 0)
        channel = StepChannel(world.control, 0)
        spec = runner.model.kv_spec
        channel.send(Kind.STARTUP, StartupPlan(kv_cache, (spec.num_layers, spec.num_kv_heads, spec.head_dim), seed))
        failed = channel.ack()
        if failed:
            raise ValueError(f"{failed} tensor-parallel rank(s) refused the start-up plan (see their log lines)")
        serving_timeouts(world, self.world.timeout_s)
        self.processes.started()
        log.info("tensor-parallel world ready", size=self.world.size, nnodes=self.world.nnodes,
                 backend=world.backend, rank0_cores=self.pin.cores, threads_per_rank=self.pin.threads)
        return MultiprocExecutor(runner, channel, self.processes, self.world.timeout_s, cores=self.pin.cores,
                                 process_mask=self.pin.process_mask)

    def abort(self) -> None:
        self.processes.started()
        self.processes.stop(grace_s=0.0)


def pin_engine_thread(config: ServeConfig) -> RankZeroPin:
    """Pin the calling thread to rank 0's cores before its first torch op (the engine thread
    at the top of the build): the OpenMP team it starts later copies the pin, so rank 0's
    threads stay off the other ranks' cores."""
    process_mask = os.sched_getaffinity(0)
    per_node = config.tensor_parallel_size // config.nnodes  # WorldSpec.per_node
    cores, threads = cores_for(0, per_node, config.torch_threads)
    bind_thread(cores)
    return RankZeroPin(cores, threads, process_mask)


def begin_tensor_parallel(config: ServeConfig, model_dir: str, pin: RankZeroPin,
                          log_level: str = "info") -> TensorParallelStart:
    """``pin``: what ``pin_engine_thread`` returned; the other ranks start under the process's
    mask (a child inherits its parent thread's) and pick their own cores from it."""
    world = world_spec_of(config)
    specs = local_rank_specs(world, 0, model_dir, config.dtype, config.torch_threads, log_level, skip_rank_zero=True,
                             linear_kernels=config.linear_kernels, attention_kernels=config.attention_kernels)
    processes = RankProcesses(specs)
    processes.start(pin.process_mask)
    processes.guard_startup()
    import torch

    torch.set_num_threads(pin.threads)  # rank 0's share, for its load (kernel choices) as for its steps
    return TensorParallelStart(world, processes, pin)
