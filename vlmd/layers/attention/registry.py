"""Which attention backend serves a device: ``attention_backend_for("cpu", block_size)``.

A factory takes ``(block_size, kernels)``: ``kernels`` is ``--attention-kernels`` (``auto``
or ``torch``), which a backend without native kernels may ignore.

Backends register by device type (the part of a device string before ``:``), so a CUDA
backend is one ``register_attention_backend("cuda", ...)`` away and the runner does not
change.
"""

from __future__ import annotations

from collections.abc import Callable

from vlmd.layers.attention.backend import AttentionBackend
from vlmd.layers.attention.cpu_paged import CPUPagedBackend

# The CPU paged backend's torch path is plain torch ops over tensors the runner has moved to
# its device, so it also serves CUDA until a CUDA kernel backend registers here (unverified
# on a GPU: none was lent to the issues that built this); its native kernel reads host
# memory only, so on CUDA it is not built at all.
_BACKENDS: dict[str, Callable[[int, str], AttentionBackend]] = {
    "cpu": CPUPagedBackend,
    "cuda": lambda block_size, kernels: CPUPagedBackend(block_size, "torch"),
}


def register_attention_backend(device_type: str, factory: Callable[[int, str], AttentionBackend]) -> None:
    _BACKENDS[device_type] = factory


def attention_backend_for(device: str, block_size: int, kernels: str = "auto") -> AttentionBackend:
    device_type = str(device).split(":", 1)[0]
    factory = _BACKENDS.get(device_type)
    if factory is None:
        raise ValueError(f"no attention backend for device {device!r} (have: {', '.join(sorted(_BACKENDS))})")
    return factory(block_size, kernels)
