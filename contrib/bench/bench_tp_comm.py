"""Per-step communication costs of tensor parallelism on this host: one JSON line.

Two processes (gloo on loopback, one core and one thread each, as ``vlmd serve
--tensor-parallel-size 2 --torch-threads 1`` runs them) time, as medians after a barrier:
the step channel's message for a decode step of 1 and 8 requests and for a new request with
a 336x336 image (bytes and rank 0's send time), all-reduces of ``[tokens, hidden]`` float32
(the model's collective), and the broadcast an encoder output would cost if only rank 0 ran
the encoder.

    python contrib/bench/bench_tp_comm.py
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
import statistics
import subprocess
import sys
import time


def _measure(rank: int, port: int) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist

    from vlmd.distributed.channel import Kind, StepChannel
    from vlmd.engine.multiproc_executor import StepMessage
    from vlmd.sched.output import CachedRequestData, SchedulerOutput

    os.sched_setaffinity(0, [rank % (os.cpu_count() or 1)])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    channel = StepChannel(dist.group.WORLD, rank)

    def timed(fn, rounds: int) -> float:
        times = []
        for _ in range(rounds):
            dist.barrier()
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return round(statistics.median(times) * 1e6, 1)

    def step(message):
        return (lambda: channel.send(Kind.STEP, message)) if rank == 0 else channel.recv

    results: dict = {}
    for count in (1, 8):
        ids = [f"chatcmpl-{i:032x}" for i in range(count)]
        out = SchedulerOutput(cached_requests=[CachedRequestData(r, [], 600 + i) for i, r in enumerate(ids)],
                              num_scheduled_tokens={r: 1 for r in ids}, total_num_scheduled_tokens=count)
        message = StepMessage(out, {r: 1234 for r in ids})
        results[f"decode_msg_{count}req_bytes"] = len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        results[f"decode_msg_{count}req_send_us"] = timed(step(message), 300)
    image = {"pixels": np.zeros((3, 336, 336), dtype=np.uint8), "token_ids": list(range(600))}
    results["image_msg_bytes"] = len(pickle.dumps(image, protocol=pickle.HIGHEST_PROTOCOL))
    results["image_msg_send_us"] = timed(step(image), 50)
    for rows, hidden in ((1, 64), (8, 64), (1, 768), (8, 768), (200, 768)):
        x = torch.randn(rows, hidden)
        results[f"allreduce_{rows}x{hidden}_f32_us"] = timed(lambda: dist.all_reduce(x), 300)
    for rows, hidden in ((576, 64), (576, 768)):
        x = torch.randn(rows, hidden)
        results[f"broadcast_encoder_out_{rows}x{hidden}_f32_us"] = timed(lambda: dist.broadcast(x, 0), 50)
    return results


def main() -> None:
    if len(sys.argv) == 3:  # one rank
        results = _measure(int(sys.argv[1]), int(sys.argv[2]))
        if sys.argv[1] == "0":
            print(json.dumps(results), flush=True)
        os._exit(0)  # skip the process group's teardown
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    other = subprocess.Popen([sys.executable, __file__, "1", str(port)])
    subprocess.run([sys.executable, __file__, "0", str(port)], check=True)
    other.wait()


if __name__ == "__main__":
    main()
