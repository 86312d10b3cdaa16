"""RMSNorm computed in float32, as Llama-family reference code does."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)
