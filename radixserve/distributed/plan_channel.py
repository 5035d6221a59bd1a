"""Rank 0 -> every other tensor-parallel rank: one message per step, over a gloo broadcast.

A gloo group of its own (on the CPU even when the model's collectives run on NCCL), so a plan
never waits behind the model's traffic and works across hosts. Each message is one broadcast
of a fixed ``capacity``-byte buffer (an 8-byte length, then the msgpack bytes); a message
larger than that (a long prefill's plan) takes one more broadcast of the remainder. A fixed
first buffer means the receivers need no size broadcast first: one collective per step.

Measured on a 2-core CPU VM (``benchmarks/bench_parallel.py --channel``, 2026-12-01): a decode
step's message (~1 KB) round trip is ~0.7 ms over this broadcast and ~11 µs over shared memory
with semaphores (nano-vllm's way). Shared memory cannot reach another host, and the broadcast
is one collective beside the step's 62 (SmolLM2), 0.8 % of a TP 2 decode step; so the broadcast
is the one channel.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

import radixserve.distributed.step_wire as step_wire

__all__ = ["PlanChannel"]

_HEADER = 8


class PlanChannel:
    """Sends (rank 0) or receives (the others) :mod:`~radixserve.distributed.step_wire` messages."""

    def __init__(
        self,
        backend: Any,
        rank: int,
        send_timeout: datetime.timedelta,
        recv_timeout: datetime.timedelta,
        capacity: int = 16 << 10,
    ) -> None:
        """``send_timeout`` bounds rank 0's sends; ``recv_timeout`` a receiver's wait, which
        spans the worker's idle time (a dead rank 0 ends it at once: its sockets close)."""
        self.backend = backend
        self.rank = rank
        self.capacity = capacity
        self._timeout = send_timeout if rank == 0 else recv_timeout
        self._buf = torch.zeros(capacity, dtype=torch.uint8)
        self.messages = 0
        self.bytes = 0
        self.seconds = 0.0  # spent in send/recv (the benchmark's plan-broadcast figure)

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self._timeout
        self.backend.broadcast([t], opts).wait()

    def send(self, msg: step_wire.Message) -> None:
        """Broadcast ``msg`` (rank 0)."""
        t0 = time.perf_counter()
        data = step_wire.encode(msg)
        n = len(data)
        head = min(n, self.capacity - _HEADER)
        buf = self._buf
        buf[:_HEADER].copy_(torch.tensor([n], dtype=torch.int64).view(torch.uint8))
        buf[_HEADER : _HEADER + head].copy_(
            torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
        )
        self._broadcast(buf)
        if n > head:
            self._broadcast(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8))
        self.messages += 1
        self.bytes += n
        self.seconds += time.perf_counter() - t0

    def recv(self) -> step_wire.Message:
        """The next message from rank 0 (the other ranks)."""
        buf = self._buf
        self._broadcast(buf)
        n = int(buf[:_HEADER].view(torch.int64)[0])
        head = min(n, self.capacity - _HEADER)
        data = buf[_HEADER : _HEADER + head].numpy().tobytes()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        return step_wire.decode(data)
