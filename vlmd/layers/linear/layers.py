"""The linear layers model code uses, shaped for tensor parallelism.

Each layer holds only this rank's shard and each parameter carries a ``weight_loader`` that
copies this rank's slice out of a full checkpoint tensor:
- ``ReplicatedLinear``: every rank holds the whole weight;
- ``ColumnParallelLinear``: output features split across ranks (each rank computes a slice
  of the outputs, no communication); ``MergedColumnParallelLinear`` fuses several such
  outputs (gate/up), ``QKVParallelLinear`` fuses q/k/v by heads (k/v heads replicated when
  there are fewer of them than ranks);
- ``RowParallelLinear``: input features split; partial sums are all-reduced, then the bias
  (held whole by every rank) is added once.
At tp size 1 every slice is the whole tensor and the all-reduce is the identity.

How the product is computed (``F.linear`` or pre-packed oneDNN weights, thread count) is
chosen per layer after loading by :func:`vlmd.layers.linear.selection.select_linear_kernels`;
until then ``forward`` is plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmd.layers.linear.kernels import SelectedKernel
from vlmd.layers.linear.parallel import SINGLE, TPGroup, all_reduce


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup):
        """``input_size`` / ``output_size`` are this rank's (already divided) sizes."""
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.kernel: SelectedKernel | None = None

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is None:
            return F.linear(x, self.weight, bias)
        return self.kernel(x, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        kernel = "plain" if self.kernel is None else ",".join(c.name for c in self.kernel.choices)
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, tp={self.tp.rank}/{self.tp.size}, kernel={kernel}"


def _copy(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: checkpoint shard has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded.to(param.dtype))


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, tp: TPGroup = SINGLE):
        super().__init__(input_size, output_size, bias, tp)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        _copy(param, loaded, "replicated linear")


class ColumnParallelLinear(LinearBase):
    """Output features split: rank r holds rows [r * out/tp, (r + 1) * out/tp)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, tp: TPGroup = SINGLE):
        super().__init__(input_size, tp.split(output_size, "output size"), bias, tp)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        rows = param.shape[0]
        _copy(param, loaded.narrow(0, self.tp.rank * rows, rows), "column-parallel linear")


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs in one matmul (gate and up); ``shard_id`` indexes them."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, tp: TPGroup = SINGLE):
        self.output_sizes = [tp.split(size, "output size") for size in output_sizes]
        super().__init__(input_size, sum(self.output_sizes), bias, tp)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"merged linear shard {shard_id!r} is not one of 0..{len(self.output_sizes) - 1}")
        rows = self.output_sizes[shard_id]
        target = param.narrow(0, sum(self.output_sizes[:shard_id]), rows)
        _copy(target, loaded.narrow(0, self.tp.rank * rows, rows), f"merged linear shard {shard_id}")


class QKVParallelLinear(LinearBase):
    """q, k and v projections fused, split across ranks by heads.

    With fewer k/v heads than ranks each k/v head is replicated on ``tp / num_kv_heads``
    consecutive ranks (as GQA groups line up with them).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = True, tp: TPGroup = SINGLE):
        self.head_dim = head_dim
        self.num_heads = tp.split(num_heads, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.split(num_kv_heads, "key/value heads")
            self.kv_replicas = 1
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor-parallel size {tp.size} is not a multiple of {num_kv_heads} key/value heads")
            self.num_kv_heads, self.kv_replicas = 1, tp.size // num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, tp)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id == "q":
            offset, rows, index = 0, self.q_size, self.tp.rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            rows, index = self.kv_size, self.tp.rank // self.kv_replicas
        else:
            raise ValueError(f"qkv shard {shard_id!r} is not one of 'q', 'k', 'v'")
        _copy(param.narrow(0, offset, rows), loaded.narrow(0, index * rows, rows), f"qkv shard {shard_id}")


class RowParallelLinear(LinearBase):
    """Input features split: rank r holds columns [r * in/tp, (r + 1) * in/tp) and gets the
    matching slice of the input (the output of a column-parallel layer)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, tp: TPGroup = SINGLE,
                 reduce_results: bool = True):
        super().__init__(tp.split(input_size, "input size"), output_size, bias, tp)
        self.reduce_results = reduce_results

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is whole on every rank
            _copy(param, loaded, "row-parallel bias")
            return
        columns = param.shape[1]
        _copy(param, loaded.narrow(1, self.tp.rank * columns, columns), "row-parallel linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.product(x, self.bias)
        if not self.reduce_results:  # the caller reduces: only one rank may add the bias
            return self.product(x, self.bias if self.tp.rank == 0 else None)
        # Partial sums first, the bias once after the reduction.
        out = all_reduce(self.product(x, None), self.tp)
        return out if self.bias is None else out + self.bias
