"""The step channel: rank 0 broadcasts each step's plain data to every other rank.

A message is a kind and a payload of plain data (dataclasses of ints, lists, strings and
arrays: the SchedulerOutput, never tensors of the model), written by ``step_codec`` (typed,
allow-listed; never pickle: D92). It travels in one gloo broadcast
of a fixed ``SMALL`` byte frame whose first 16 bytes are ``(kind, payload length)``: a
decode step's message fits, so it costs one collective; a larger payload (new requests with
their media) follows in a second broadcast of exactly its size. ``broadcast_object_list``
would always cost two (sizes, then bytes).

``ack`` is an all-reduce every rank must join: a ping followed by an ack proves each rank
is alive and listening, which a broadcast alone does not (its root may finish sending into
socket buffers of a rank that has stopped). Every operation is bounded by the group's
timeout (``--distributed-timeout-s``).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from vlmd.distributed import step_codec

SMALL = 4096
_HEADER = struct.Struct("<qq")


class Kind(IntEnum):
    STARTUP = 1
    STEP = 2
    PING = 3
    SHUTDOWN = 4


@dataclass
class ChannelStats:
    messages: int = 0
    bytes: int = 0  # payload bytes broadcast (frames included)
    seconds: float = 0.0  # spent in broadcasts on rank 0


class StepChannel:
    def __init__(self, group, rank: int):
        self.group = group
        self.rank = rank
        self.stats = ChannelStats()
        self._frame = torch.zeros(SMALL, dtype=torch.uint8)
        self._ack = torch.zeros(1, dtype=torch.int64)

    def send(self, kind: Kind, payload=None) -> None:
        """Rank 0 only."""
        started = time.perf_counter()
        data = b"" if payload is None else step_codec.encode(payload)
        frame = self._frame.numpy()
        frame[: _HEADER.size] = memoryview(_HEADER.pack(int(kind), len(data))).cast("B")
        inline = len(data) <= SMALL - _HEADER.size
        if inline:
            frame[_HEADER.size : _HEADER.size + len(data)] = memoryview(data).cast("B") if data else []
        dist.broadcast(self._frame, 0, group=self.group)
        sent = SMALL
        if not inline:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.group)
            sent += len(data)
        self.stats.messages += 1
        self.stats.bytes += sent
        self.stats.seconds += time.perf_counter() - started

    def recv(self):
        """Ranks 1..N-1: block for rank 0's next message; returns (kind, payload)."""
        dist.broadcast(self._frame, 0, group=self.group)
        kind, length = _HEADER.unpack(self._frame.numpy()[: _HEADER.size].tobytes())
        if length <= SMALL - _HEADER.size:
            data = self._frame.numpy()[_HEADER.size : _HEADER.size + length].tobytes()
        else:
            buffer = torch.empty(length, dtype=torch.uint8)
            dist.broadcast(buffer, 0, group=self.group)
            data = buffer.numpy().tobytes()
        return Kind(kind), (step_codec.decode(data) if data else None)

    def ack(self, failed: bool = False) -> int:
        """Every rank: returns how many ranks reported a failure."""
        self._ack.fill_(1 if failed else 0)
        dist.all_reduce(self._ack, group=self.group)
        return int(self._ack.item())
