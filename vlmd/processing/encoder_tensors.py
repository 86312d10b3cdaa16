"""Encoder outputs between torch and the wire (``vlmd/encoder_wire.py``): the two ends'
only torch code, so the format module and the HTTP route stay torch-free."""

from __future__ import annotations

import torch

from vlmd.encoder_wire import WireFormatError, WireTensor

_WIRE_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_TORCH_DTYPES = {name: dtype for dtype, name in _WIRE_DTYPES.items()}


def to_wire(modality: str, tensor: torch.Tensor) -> WireTensor:
    """A CPU copy of ``tensor``'s bytes (little-endian, as every host torch runs on)."""
    if tensor.dtype not in _WIRE_DTYPES:
        raise WireFormatError(f"an encoder output of dtype {tensor.dtype} has no wire dtype")
    cpu = tensor.detach().to("cpu").contiguous()
    data = cpu.view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return WireTensor(modality, _WIRE_DTYPES[tensor.dtype], tuple(cpu.shape), data)


def from_wire(tensor: WireTensor) -> torch.Tensor:
    """The tensor a wire entry holds (its own memory: the body may be freed)."""
    dtype = _TORCH_DTYPES[tensor.dtype]
    if not len(tensor.data):
        return torch.empty(tensor.shape, dtype=dtype)
    return torch.frombuffer(bytearray(tensor.data), dtype=torch.uint8).view(dtype).reshape(tensor.shape)
