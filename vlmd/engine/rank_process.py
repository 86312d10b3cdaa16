"""One tensor-parallel rank other than 0: ``python -m vlmd.engine.rank_process SPEC_JSON``.

It binds itself to its cores, joins the world, loads its shard of the weights, takes the
KV-cache size rank 0 decided, then runs every step rank 0 broadcasts, forever: the same
runner code as rank 0, but it never computes logits or samples (rank 0's tokens arrive with
the next step). It exits 0 on SHUTDOWN and non-zero, with a log line naming itself, when
rank 0 goes silent or away (a collective fails or times out) or its parent process dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import structlog

log = structlog.get_logger(__name__)


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when the process that started it dies, however it died."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def run(spec) -> int:
    import torch

    from vlmd.distributed.channel import Kind, StepChannel
    from vlmd.distributed.world import bind_thread, cores_for, init_world, serving_timeouts
    from vlmd.engine.builder import DTYPES, load_model
    from vlmd.engine.multiproc_executor import is_collective_error
    from vlmd.layers.linear import TPGroup
    from vlmd.runner.model_runner import ModelRunner

    world_spec = spec.world_spec
    cores, threads = cores_for(spec.local_index, spec.local_ranks, spec.torch_threads)
    bind_thread(cores)
    torch.set_num_threads(threads)
    started = time.perf_counter()
    world = init_world(world_spec, spec.rank)
    model = load_model(spec.model_dir, DTYPES[spec.dtype], TPGroup(world.size, world.rank),
                       linear_kernels=spec.linear_kernels)
    channel = StepChannel(world.control, world.rank)
    kind, plan = channel.recv()
    if kind is not Kind.STARTUP:
        raise RuntimeError(f"expected the start-up plan from rank 0, got {kind.name}")
    ours = (model.kv_spec.num_layers, model.kv_spec.num_kv_heads, model.kv_spec.head_dim)
    mismatch = tuple(plan.kv_spec) != ours
    if mismatch:
        log.error("rank's KV shape differs from rank 0's (different checkpoint or settings?)",
                  rank=world.rank, ours=ours, rank0=tuple(plan.kv_spec))
    if channel.ack(failed=mismatch) or mismatch:
        return 1
    serving_timeouts(world, world_spec.timeout_s)
    runner = ModelRunner(model, plan.kv_cache, DTYPES[spec.dtype], seed=plan.seed, samples=False,
                         attention_kernels=spec.attention_kernels)
    log.info("tensor-parallel rank ready", rank=world.rank, cores=cores, threads=threads,
             kv_blocks=plan.kv_cache.num_blocks, seconds=round(time.perf_counter() - started, 2))
    out = None  # the step being run (re-runs of a failed step reuse it)
    while True:
        try:
            kind, payload = channel.recv()
        except Exception as exc:
            log.error("tensor-parallel rank lost rank 0; exiting", rank=world.rank, error=str(exc).splitlines()[0][:300])
            return 1
        if kind is Kind.STEP:
            runner.append_sampled(payload.sampled)
            try:
                if payload.out is not None:
                    runner.apply_schedule(payload.out)
                    out = payload.out
                if payload.num_computed_tokens:
                    runner.set_computed(payload.num_computed_tokens)
                if payload.request_ids:
                    runner.run(out, payload.request_ids)
            except Exception as exc:
                if is_collective_error(exc):
                    log.error("tensor-parallel rank lost a peer mid-step; exiting", rank=world.rank,
                              error=str(exc).splitlines()[0][:300])
                    return 1
                # The model's own error is raised on every rank at the same point; rank 0
                # finds the request that caused it by re-running parts of the step, and
                # those re-runs arrive as further messages.
                log.warning("step failed on this rank as on rank 0", rank=world.rank, error=f"{type(exc).__name__}: {exc}")
        elif kind is Kind.PING:
            channel.ack()
        elif kind is Kind.SHUTDOWN:
            log.info("tensor-parallel rank shutting down", rank=world.rank)
            return 0


def main(argv: list[str]) -> None:
    from vlmd.engine.rank_launcher import RankSpec
    from vlmd.logs import configure_logging

    _die_with_parent()
    spec = RankSpec.from_json(argv[0])
    configure_logging(spec.log_level)
    structlog.contextvars.bind_contextvars(rank=spec.rank)
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))  # told to stop: nothing to save
    try:
        code = run(spec)
    except Exception:
        log.exception("tensor-parallel rank failed", rank=spec.rank)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a process group destroyed after a peer is lost aborts.
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
