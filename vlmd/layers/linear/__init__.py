"""The one linear layer seam of the model code (see layers.py, kernels.py, selection.py)."""

from vlmd.layers.linear.adopt import adopt_linear_modules
from vlmd.layers.linear.layers import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vlmd.layers.linear.parallel import SINGLE, TPGroup, all_reduce
from vlmd.layers.linear.selection import select_linear_kernels

__all__ = [
    "adopt_linear_modules",
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "SINGLE",
    "TPGroup",
    "all_reduce",
    "select_linear_kernels",
]
