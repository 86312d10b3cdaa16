"""The binding of ``elementwise.c``: residual add + RMSNorm, RMSNorm of each head in place,
rotary in place, SiLU * up and GELU-tanh * up.

Each function serves float32 CPU tensors whose rows are contiguous (rows may be strided);
``serves(*tensors)`` says whether a call would, and the layers keep their torch ops for
everything else (another dtype or device, or where the kernel did not build). The residual
add + RMSNorm, rotary and SiLU * up also serve bfloat16 rows (``serves_bf16``), rounding
where torch's bfloat16 ops round.
"""

from __future__ import annotations


import torch

from vlmd.layers.cpu.library import load_functions

# signatures: kernels.h
_NAMES = ("vlmd_add_rms_norm", "vlmd_head_rms_norm", "vlmd_rotary", "vlmd_silu_mul", "vlmd_gelu_tanh_mul",
          "vlmd_add_rms_norm_bf16", "vlmd_silu_mul_bf16", "vlmd_rotary_bf16")


def _kernel() -> dict | None:
    # Holding the GIL: a call takes microseconds, less than waiting to take the GIL back
    # from the event loop's thread (c8, one image repeated, servers alternated five times:
    # 10.9 against 10.4 req/s, medians; docs/decisions.md D51).
    return load_functions(_NAMES, hold_gil=True)


def available() -> bool:
    return _kernel() is not None


def serves(*tensors: torch.Tensor) -> bool:
    """Float32 CPU tensors of 2 dimensions with contiguous rows, and a kernel built here.
    (Asked ~40 times a decode step: a plain loop, no generator.)"""
    if not available():
        return False
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1:
            return False
    return True


def serves_bf16(*tensors: torch.Tensor) -> bool:
    """As ``serves``, for bfloat16 CPU tensors."""
    if not available():
        return False
    for t in tensors:
        if t.dtype != torch.bfloat16 or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1:
            return False
    return True


def _require_rows(*tensors: torch.Tensor) -> None:
    """The kernels read raw memory: anything but float32 CPU rows would be misread."""
    if not serves(*tensors):
        raise ValueError("the native elementwise kernels take float32 CPU tensors [rows, width] with contiguous rows")


def _checked(code: int, what: str) -> None:
    if code != 0:
        raise ValueError(f"native {what} cannot serve these tensors (code {code})")


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``hidden += delta`` in place (when given), then RMSNorm of ``hidden`` times ``weight``,
    as a new [rows, width] tensor. bfloat16 rows and weight: each step rounded as torch's
    bfloat16 ops round (``norm.RMSNorm``)."""
    tensors = (hidden, weight.view(1, -1), *(() if delta is None else (delta,)))
    bf16 = serves_bf16(*tensors)
    if not bf16:
        _require_rows(*tensors)
    rows, width = hidden.shape
    if weight.shape != (width,) or (delta is not None and delta.shape != hidden.shape):
        raise ValueError(f"shapes {tuple(hidden.shape)}, {None if delta is None else tuple(delta.shape)} "
                         f"and weight {tuple(weight.shape)} do not match")
    out = torch.empty(rows, width, dtype=hidden.dtype)
    _checked(_kernel()["vlmd_add_rms_norm_bf16" if bf16 else "vlmd_add_rms_norm"](
        hidden.data_ptr(), hidden.stride(0), None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(), width, rows, width, eps,
        torch.get_num_threads()), "RMSNorm")
    return out


def head_rms_norm_(x: torch.Tensor, first: int, heads: int, dim: int, weight: torch.Tensor, eps: float) -> None:
    """RMSNorm in place of ``heads`` heads of size ``dim`` of each row of ``x`` [rows, width],
    starting at column ``first``, each head by ``weight`` [dim] (Qwen3's q and k norms,
    on the q/k/v product's rows). A head's result is ``add_rms_norm``'s for that head as a row."""
    _require_rows(x, weight.view(1, -1))
    rows = x.shape[0]
    if first < 0 or x.shape[1] < first + heads * dim or weight.shape != (dim,):
        raise ValueError(f"{heads} heads of {dim} from column {first} over {tuple(x.shape)} "
                         f"with weight {tuple(weight.shape)}")
    _checked(_kernel()["vlmd_head_rms_norm"](x.data_ptr() + first * x.element_size(), x.stride(0), heads, dim,
                                             weight.data_ptr(), eps, rows, torch.get_num_threads()), "RMSNorm")


def rotary_(x: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half rotary embedding in place on the first ``heads`` heads of size ``dim`` of
    each row of ``x`` [rows, >= heads * dim]; ``cos``/``sin`` [rows, dim] (one row a token).
    bfloat16 rows and tables: each product and the sum rounded as torch's bfloat16 ops round."""
    bf16 = serves_bf16(x, cos, sin)
    if not bf16:
        _require_rows(x, cos, sin)
    rows = x.shape[0]
    if x.shape[1] < heads * dim or cos.shape != (rows, dim) or sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(f"rotary of {heads} heads of {dim} over {tuple(x.shape)} with tables {tuple(cos.shape)}")
    _checked(_kernel()["vlmd_rotary_bf16" if bf16 else "vlmd_rotary"](
        x.data_ptr(), x.stride(0), heads, dim, cos.data_ptr(), sin.data_ptr(), cos.stride(0), rows,
        torch.get_num_threads()), "rotary")


def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """``silu(gate_up[:, :width]) * gate_up[:, width:2 * width]`` as a new [rows, width] tensor
    of ``gate_up``'s dtype (bfloat16: the activation rounded before the product, as torch's)."""
    return _gated(gate_up, width, "vlmd_silu_mul", "SiLU", bf16_name="vlmd_silu_mul_bf16")


def gelu_tanh_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """``gelu(gate_up[:, :width], approximate="tanh") * gate_up[:, width:2 * width]`` as a new
    [rows, width] tensor (Gemma's MLP), to float32 rounding of torch's."""
    return _gated(gate_up, width, "vlmd_gelu_tanh_mul", "GELU-tanh")


def _gated(gate_up: torch.Tensor, width: int, name: str, what: str, bf16_name: str | None = None) -> torch.Tensor:
    """Float32 rows into float32 (``name``); bfloat16 rows into bfloat16 where the activation
    has a bfloat16 twin (``bf16_name``), anything else refused (the kernel would misread it)."""
    bf16 = bf16_name is not None and serves_bf16(gate_up)
    if not bf16:
        _require_rows(gate_up)
    rows = gate_up.shape[0]
    if gate_up.shape[1] < 2 * width:
        raise ValueError(f"gate and up of {width} each do not fit rows of {gate_up.shape[1]}")
    out = torch.empty(rows, width, dtype=gate_up.dtype)
    _checked(_kernel()[bf16_name if bf16 else name](gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), width,
                                                    rows, width, torch.get_num_threads()), what)
    return out
