"""Which padded batch a decode step runs as under CUDA graphs. Torch-free.

A CUDA graph replays kernels with the shapes it was captured with, so a backend that runs
decode steps as graphs captures one graph per batch size of a fixed set (the buckets) and
runs a step of ``B`` decodes as the smallest bucket that holds them, its extra rows padding
(``layers/attention/flex.py``: copies of the first decode, whose K/V they rewrite with the
same values). Buckets are 1, 2, 4, 8, then every multiple of 8 up to 32, then of 16 up to
the largest (vLLM's capture sizes have the same shape): a step is padded by at most 7 rows
up to 32 decodes and 15 past that, while the number of graphs, each one a capture on first
use, stays near ``max_batch / 16``.
"""

from __future__ import annotations

SMALL_BUCKETS = (1, 2, 4, 8)


def graph_buckets(max_batch: int, *, fine_step: int = 8, fine_until: int = 32,
                  coarse_step: int = 16) -> tuple[int, ...]:
    """The batch sizes graphs are captured for, ascending, the last one ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"the largest decode batch must be >= 1, got {max_batch}")
    if not 0 < fine_step <= coarse_step or fine_until < fine_step:
        raise ValueError(f"bucket steps must satisfy 0 < fine_step <= coarse_step and fine_until >= fine_step, "
                         f"got {fine_step}, {coarse_step}, {fine_until}")
    sizes = {size for size in SMALL_BUCKETS if size <= max_batch}
    sizes.update(range(fine_step, min(fine_until, max_batch) + 1, fine_step))
    sizes.update(range(fine_until + coarse_step, max_batch + 1, coarse_step))
    sizes.add(max_batch)
    return tuple(sorted(sizes))


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``batch`` decodes, or None when the largest cannot
    (that step runs without a graph)."""
    if batch < 1:
        raise ValueError(f"a decode step has >= 1 decodes, got {batch}")
    for size in buckets:
        if size >= batch:
            return size
    return None
