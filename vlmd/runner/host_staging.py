"""Moving a step's host-built tensors to the runner's device.

The batch builder makes small CPU tensors every step (token ids, positions, slot mappings,
masks). On the CPU device they are used as they are. On CUDA each one is copied into a
pinned host buffer kept per field (grown when a step needs more, never shrunk) and sent with
one non-blocking copy, so no step allocates page-locked memory and the copies overlap the
host's work. A buffer is only rewritten after the previous step's copies have completed (a
CUDA event), whether or not that step synchronised for sampling.

The walk is generic over dataclasses and lists, so attention metadata of any backend moves
without this module naming its fields.
"""

from __future__ import annotations

import dataclasses

import torch


class HostStaging:
    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied = None  # torch.cuda.Event of the last step's copies

    @property
    def passthrough(self) -> bool:
        return self.device.type == "cpu"

    def to_device(self, value, path: str = "step"):
        """``value`` with every CPU tensor in it (through dataclasses and lists) on the device."""
        if self.passthrough:
            return value
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers may be rewritten now
            self._copied = None
        moved = self._walk(value, path)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return moved

    def _walk(self, value, path: str):
        if isinstance(value, torch.Tensor):
            return value if value.device == self.device else self._copy(path, value)
        if isinstance(value, list):
            return [self._walk(item, f"{path}[{index}]") for index, item in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self._walk(item, f"{path}[{index}]") for index, item in enumerate(value))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changed = {}
            for spec in dataclasses.fields(value):
                current = getattr(value, spec.name)
                moved = self._walk(current, f"{path}.{spec.name}")
                if moved is not current:
                    changed[spec.name] = moved
            return dataclasses.replace(value, **changed) if changed else value
        return value

    def _copy(self, path: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.dtype != tensor.dtype or buffer.numel() < tensor.numel():
            size = max(tensor.numel(), 2 * buffer.numel() if buffer is not None else 0)
            buffer = torch.empty(size, dtype=tensor.dtype, pin_memory=True)
            self._buffers[path] = buffer
        staged = buffer[: tensor.numel()].view(tensor.shape)
        staged.copy_(tensor)
        return staged.to(self.device, non_blocking=True)
