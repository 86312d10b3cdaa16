"""Which attention backend serves a device: ``attention_backend_for("cpu", block_size)``.

A factory takes ``(block_size, kernels)``: ``kernels`` is ``--attention-kernels`` (``auto``,
``torch`` or ``flex``), which a backend without native kernels may ignore.

Backends register by device type (the part of a device string before ``:``), so a CUDA
backend is one ``register_attention_backend("cuda", ...)`` away and the runner does not
change.
"""

from __future__ import annotations

from collections.abc import Callable

from vlmd.layers.attention.backend import AttentionBackend
from vlmd.layers.attention.cpu_paged import CPUPagedBackend
from vlmd.layers.attention.flex import FlexBackend


def cpu_backend(block_size: int, kernels: str) -> AttentionBackend:
    """The CPU's: the paged backend (its native kernels, or torch ops alone), or, with
    ``flex``, the CUDA backend's code run eagerly (for its parity tests)."""
    return FlexBackend(block_size, kernels) if kernels == "flex" else CPUPagedBackend(block_size, kernels)


def cuda_backend(block_size: int, kernels: str) -> AttentionBackend:
    """CUDA's: FlexAttention (``auto``, ``flex``), or with ``torch`` the paged backend's
    torch path (plain torch ops over the device's tensors; its native kernels read host
    memory only). Neither has run on a GPU yet (docs/decisions.md D96)."""
    return CPUPagedBackend(block_size, "torch") if kernels == "torch" else FlexBackend(block_size, kernels)


_BACKENDS: dict[str, Callable[[int, str], AttentionBackend]] = {
    "cpu": cpu_backend,
    "cuda": cuda_backend,
}


def register_attention_backend(device_type: str, factory: Callable[[int, str], AttentionBackend]) -> None:
    _BACKENDS[device_type] = factory


def attention_backend_for(device: str, block_size: int, kernels: str = "auto") -> AttentionBackend:
    device_type = str(device).split(":", 1)[0]
    factory = _BACKENDS.get(device_type)
    if factory is None:
        raise ValueError(f"no attention backend for device {device!r} (have: {', '.join(sorted(_BACKENDS))})")
    return factory(block_size, kernels)
