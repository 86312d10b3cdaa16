"""RMSNorm computed in float32, as Llama-family reference code does.

Float32 CPU rows take the native kernel (``layers/cpu/elementwise.c``), which also
fuses the residual add before the norm (``add_forward``): one pass instead of ~8 torch ops.
bfloat16 rows with a bfloat16 weight take its bfloat16 twin, which rounds where
``reference``'s torch ops round (a subclass with another reference says it has no twin).
"""

from __future__ import annotations

import torch

from vlmd.layers.cpu import elementwise


class RMSNorm(torch.nn.Module):
    # Whether bfloat16 rows may take the kernel's bfloat16 twin: it computes this class's
    # ``reference``, so a subclass that changes ``reference`` sets this False.
    BFLOAT16_TWIN = True

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def kernel_weight(self) -> torch.Tensor | None:
        """What the native kernel scales each normed column by (float32 CPU), or None where
        the kernel cannot serve this norm's weight. A subclass whose norm scales by something
        other than the weight (Gemma's ``1 + w``) says so here and in ``reference``."""
        weight = self.weight
        return weight if weight.dtype == torch.float32 and weight.is_cpu else None

    def _bf16_twin(self, *rows: torch.Tensor) -> bool:
        return self.BFLOAT16_TWIN and elementwise.serves_bf16(*rows, self.weight.view(1, -1))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The norm in torch ops, for rows the kernel does not serve."""
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if elementwise.serves(x):
            weight = self.kernel_weight()
            if weight is not None:
                return elementwise.add_rms_norm(x, None, weight, self.eps)
        if self._bf16_twin(x):
            return elementwise.add_rms_norm(x, None, self.weight, self.eps)
        return self.reference(x)

    def heads_(self, rows: torch.Tensor, first: int, heads: int) -> None:
        """Norm in place ``heads`` heads (each this norm's width) of every row of ``rows``
        [T, width], from column ``first``: a q/k/v product's q or k heads (Qwen3). Float32
        CPU rows take the kernel the fused decode step runs (``head_rms_norm_``), so the
        two paths agree bit for bit; anything else torch ops, each head as a row."""
        dim = self.weight.shape[0]
        if elementwise.serves(rows):
            weight = self.kernel_weight()
            if weight is not None:
                elementwise.head_rms_norm_(rows, first, heads, dim, weight, self.eps)
                return
        part = rows[:, first:first + heads * dim]
        part.copy_(self.forward(part.reshape(-1, dim)).view(part.shape))

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of ``residual + delta``, that sum). The native kernel adds into
        ``residual`` in place, so the caller hands over a residual it owns."""
        if elementwise.serves(residual, delta):
            weight = self.kernel_weight()
            if weight is not None:
                return elementwise.add_rms_norm(residual, delta, weight, self.eps), residual
        if self._bf16_twin(residual, delta):
            return elementwise.add_rms_norm(residual, delta, self.weight, self.eps), residual
        residual = residual + delta
        return self.forward(residual), residual
