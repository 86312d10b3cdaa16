"""Which tensor-parallel rank this process is, and the one collective linear layers need.

Today vlmd runs one rank (``TPGroup()`` = size 1, rank 0) and every collective is the
identity. Layers take a ``TPGroup`` as a constructor argument rather than reading a global,
so a sharded model is the same code built with a different group, and a test can build
rank 1 of 2 in one process to check what each rank would load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPGroup:
    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")

    def split(self, size: int, what: str) -> int:
        """This rank's share of ``size`` (which must divide evenly)."""
        if size % self.size:
            raise ValueError(f"{what} {size} is not divisible by tensor-parallel size {self.size}")
        return size // self.size


SINGLE = TPGroup()


def all_reduce(tensor: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Sum partial results of a row-parallel product over the group's ranks.

    The identity at size 1 (no process group exists then); a multi-rank build must wire a
    torch.distributed group here before it can run.
    """
    if group.size == 1:
        return tensor
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"tensor-parallel size {group.size} needs an initialised torch.distributed group")
    dist.all_reduce(tensor)
    return tensor
