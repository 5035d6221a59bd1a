"""One packed copy each way per step: the runner's only host/device transfer points.

Host to device: every integer and float input of a step (token ids, positions, KV slots,
page-table entries, sequence lengths, logits rows, sampling parameters, grammar masks,
penalty token lists, random draws) is laid out by name in a :class:`StagingLayout`, written
into one host buffer (pinned on CUDA) and sent with one non-blocking copy; the device side
gets views of the one device buffer::

    host  [ int fields (lists, then host tensors) .................. | float fields ........ ]
             int64                                                      float64 (bit-cast view)
      │  one copy_(non_blocking=True)
      ▼
    device buffer (same layout) ──> staged.i("positions"), staged.f("temperature"), ...

Device to host: the step's results (sampled tokens, their logprobs, prompt logprobs) are
cast to float64 (exact for token ids below 2**53), concatenated on the device and read with
one copy. :class:`TransferCounter` counts both, so a test can hold the line at one each.

Host buffers alternate between two so that packing step N+1 never overwrites the bytes a
still-running copy of step N reads (CUDA copies from pinned memory are asynchronous).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

_INT, _FLOAT = torch.int64, torch.float64


@dataclass
class TransferCounter:
    """Host/device copies made through the staging points (cumulative)."""

    h2d: int = 0
    d2h: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0


class LayoutFields(msgspec.Struct, array_like=True):
    """A :class:`StagingLayout`'s fields as plain values (sent to the other tensor-parallel ranks)."""

    int_lists: list[tuple[str, int]]
    ints: list[int]
    int_tensors: list[tuple[str, list[int]]]
    float_lists: list[tuple[str, int]]
    floats: list[float]


class StagingLayout:
    """The host side of one step's inputs: named int64 and float64 fields, in order."""

    def __init__(self) -> None:
        self._int_lists: list[tuple[str, int]] = []  # (name, length), values in self._ints
        self._ints: list[int] = []
        self._int_tensors: list[tuple[str, torch.Tensor]] = []  # host tensors, copied as they are
        self._float_lists: list[tuple[str, int]] = []
        self._floats: list[float] = []

    def ints(self, name: str, values: Sequence[int]) -> None:
        """Add an int64 field (a list; appended to one Python list, converted once)."""
        self._int_lists.append((name, len(values)))
        self._ints.extend(values)

    def int_tensor(self, name: str, values: torch.Tensor) -> None:
        """Add an int64 field from a host tensor of any integer dtype (flattened)."""
        self._int_tensors.append((name, values.reshape(-1)))

    def floats(self, name: str, values: Sequence[float]) -> None:
        """Add a float64 field."""
        self._float_lists.append((name, len(values)))
        self._floats.extend(values)

    def merge(self, other: StagingLayout) -> None:
        """Append ``other``'s fields (field names must not repeat)."""
        self._int_lists += other._int_lists
        self._ints += other._ints
        self._int_tensors += other._int_tensors
        self._float_lists += other._float_lists
        self._floats += other._floats

    def export(self) -> LayoutFields:
        """The fields as plain values (:meth:`from_fields` rebuilds an equal layout)."""
        return LayoutFields(
            self._int_lists,
            self._ints,
            [(name, t.tolist()) for name, t in self._int_tensors],
            self._float_lists,
            self._floats,
        )

    @staticmethod
    def from_fields(fields: LayoutFields) -> StagingLayout:
        layout = StagingLayout()
        layout._int_lists = [tuple(x) for x in fields.int_lists]  # type: ignore[misc]
        layout._ints = fields.ints
        layout._int_tensors = [(n, torch.tensor(v, dtype=_INT)) for n, v in fields.int_tensors]
        layout._float_lists = [tuple(x) for x in fields.float_lists]  # type: ignore[misc]
        layout._floats = fields.floats
        return layout

    @property
    def num_ints(self) -> int:
        return len(self._ints) + sum(int(t.numel()) for _, t in self._int_tensors)

    @property
    def num_elements(self) -> int:
        return self.num_ints + len(self._floats)

    def fill(self, host: torch.Tensor) -> dict[str, tuple[int, int, bool]]:
        """Write every field into ``host`` (int64, large enough); returns name -> (offset, length, is_float)."""
        fields: dict[str, tuple[int, int, bool]] = {}
        n = len(self._ints)
        if n:
            host[:n].copy_(torch.tensor(self._ints, dtype=_INT))
        off = 0
        for name, k in self._int_lists:
            fields[name] = (off, k, False)
            off += k
        for name, t in self._int_tensors:
            k = int(t.numel())
            host[off : off + k].copy_(t)
            fields[name] = (off, k, False)
            off += k
        nf = len(self._floats)
        if nf:
            host[off : off + nf].view(_FLOAT).copy_(torch.tensor(self._floats, dtype=_FLOAT))
        for name, k in self._float_lists:
            fields[name] = (off, k, True)
            off += k
        return fields


class Staged:
    """Device views of one uploaded :class:`StagingLayout`."""

    def __init__(self, buffer: torch.Tensor, fields: dict[str, tuple[int, int, bool]]) -> None:
        self._buffer = buffer
        self._fields = fields

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def i(self, name: str) -> torch.Tensor:
        """The int64 field ``name`` on the device (a view of the step's one buffer)."""
        off, k, is_float = self._fields[name]
        assert not is_float, name
        return self._buffer[off : off + k]

    def f(self, name: str) -> torch.Tensor:
        """The float64 field ``name`` on the device."""
        off, k, is_float = self._fields[name]
        assert is_float, name
        return self._buffer[off : off + k].view(_FLOAT)


class StagingBuffer:
    """The host and device buffers of the step's one copy each way (grown on demand)."""

    def __init__(self, device: torch.device, counter: TransferCounter | None = None) -> None:
        self.device = device
        self.counter = counter if counter is not None else TransferCounter()
        self._pin = device.type == "cuda"
        self._hosts: list[torch.Tensor] = [self._host(1024), self._host(1024)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._device_buf = torch.empty(1024, dtype=_INT, device=device)
        # Two read buffers: a step's results may still be on their way while the next step launches.
        self._read_hosts = [self._host(1024).view(_FLOAT), self._host(1024).view(_FLOAT)]
        self._read_turn = 0

    def _host(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=_INT, pin_memory=self._pin)

    def upload(self, layout: StagingLayout) -> Staged:
        """Pack ``layout`` and send it with one non-blocking copy; returns the device views."""
        n = max(1, layout.num_elements)
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()  # the copy that last read this host buffer has finished
        if self._hosts[self._turn].numel() < n:
            self._hosts[self._turn] = self._host(_grow(n))
        host = self._hosts[self._turn]
        fields = layout.fill(host)
        if self._device_buf.numel() < n:
            # A fresh buffer: views handed out for an earlier step stay valid on the old one.
            self._device_buf = torch.empty(_grow(n), dtype=_INT, device=self.device)
        dev = self._device_buf[:n]
        dev.copy_(host[:n], non_blocking=self._pin)
        if self._pin:
            ev = torch.cuda.Event()
            ev.record()
            self._events[self._turn] = ev
        else:
            # CPU: the buffer is reused by the next step while this step's views may still be read
            # (overlap); a fresh device buffer per step costs one small allocation.
            self._device_buf = torch.empty_like(self._device_buf)
        self.counter.h2d += 1
        self.counter.h2d_bytes += n * 8
        return Staged(dev, fields)

    def read(self, tensors: Sequence[torch.Tensor]) -> list[list[float]]:
        """Read ``tensors`` (any dtypes, on the device) back with one copy; each as a flat list
        of floats (token ids exact)."""
        return self.read_async(tensors).wait()

    def read_async(self, tensors: Sequence[torch.Tensor]) -> PendingRead:
        """Start the one copy of ``tensors`` back to the host; :meth:`PendingRead.wait` ends it."""
        sizes = [int(t.numel()) for t in tensors]
        total = sum(sizes)
        if total == 0:
            return PendingRead(None, None, sizes)
        packed = torch.cat([t.reshape(-1).to(_FLOAT) for t in tensors])
        self._read_turn ^= 1
        if self._read_hosts[self._read_turn].numel() < total:
            self._read_hosts[self._read_turn] = self._host(_grow(total)).view(_FLOAT)
        host = self._read_hosts[self._read_turn][:total]
        host.copy_(packed, non_blocking=self._pin)
        event = None
        if self._pin:
            event = torch.cuda.Event()
            event.record()
        self.counter.d2h += 1
        self.counter.d2h_bytes += total * 8
        return PendingRead(host, event, sizes)


class PendingRead:
    """One step's results on their way to the host."""

    def __init__(
        self, host: torch.Tensor | None, event: torch.cuda.Event | None, sizes: list[int]
    ) -> None:
        self._host = host
        self._event = event
        self._sizes = sizes

    def wait(self) -> list[list[float]]:
        """Wait for the copy (CUDA: its event, not the whole device) and split it per tensor."""
        if self._host is None:
            return [[] for _ in self._sizes]
        if self._event is not None:
            self._event.synchronize()
        flat = self._host.tolist()
        out, off = [], 0
        for k in self._sizes:
            out.append(flat[off : off + k])
            off += k
        return out


def _grow(n: int) -> int:
    return 1 << max(10, (n - 1).bit_length())
