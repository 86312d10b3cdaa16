"""Gated activations: ``act(gate) * up`` over a fused [gate | up] product's rows.

Float32 CPU rows with SiLU or GELU-tanh, and bfloat16 CPU rows with SiLU, take the CPU room's
kernels (``layers/cpu/elementwise.c``: one pass, no [T, 2I] temporaries); anything else torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlmd.layers.cpu import elementwise

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}

# The gated activations the CPU room runs natively (``decoder_step.c`` runs the same ones,
# so a fused decode step equals the module path bit for bit).
_NATIVE = {"silu": elementwise.silu_mul, "gelu_pytorch_tanh": elementwise.gelu_tanh_mul}


def check_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not one of {', '.join(ACTIVATIONS)}")
    return name


def gated_activation(gate_up: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """``act(gate_up[:, :width]) * gate_up[:, width:2 * width]`` as a new [rows, width] tensor."""
    if name in _NATIVE and elementwise.serves(gate_up):
        return _NATIVE[name](gate_up, width)
    if name == "silu" and elementwise.serves_bf16(gate_up):
        return elementwise.silu_mul(gate_up, width)
    gate, up = gate_up[..., :2 * width].split(width, dim=-1)
    return ACTIVATIONS[name](gate) * up


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's soft cap, ``tanh(x / cap) * cap`` (transformers' order), or ``x`` where ``cap``
    is None."""
    return x if cap is None else torch.tanh(x / float(cap)) * float(cap)
