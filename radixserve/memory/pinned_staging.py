"""Pinned host staging for page copies between the device pool and the host pool (L2).

A copy between device memory and *pageable* host memory is synchronous: the driver stages
it through its own pinned buffer while the host thread waits, so it cannot overlap the
compute stream. ``index_select`` on the pinned L2 pool returns a pageable tensor, and a
device-to-host ``.to("cpu")`` returns one too; both made demotions and load-backs block.
The page copier gathers the pages into one of these pinned buffers instead and copies
with ``non_blocking=True`` on its copy stream, recording an event:

    demotion (L1 -> L2)   device gather -> pinned staging (async D2H, event) ... later,
                          before anything reads or reuses the L2 slots: event wait, then
                          the host scatter into the L2 slots (``PendingScatter.finish``)
    load-back (L2 -> L1)  host gather into pinned staging -> device (async H2D) -> device
                          scatter; the staging buffer is reused only once its event passed

A buffer is handed out again only after the event of the copy that last used it has
completed, so a copy in flight never has its source or destination overwritten.
On the CPU (tests) the same path runs with events that are complete at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class CopyEvent(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DoneEvent:
    """The event of a synchronous copy (the CPU): complete when recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def record_event(stream: torch.cuda.Stream | None) -> CopyEvent:
    """An event recorded on ``stream`` now (a :class:`DoneEvent` without one)."""
    if stream is None:
        return DoneEvent()
    event = torch.cuda.Event()
    event.record(stream)
    return event


class PinnedStaging:
    """Reusable pinned host buffers (flat, one dtype each, sized in powers of two)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._busy: list[tuple[CopyEvent, torch.Tensor]] = []
        self.allocated = 0  # buffers made (tests: reuse keeps this flat)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pinned tensor of ``shape`` whose buffer no copy in flight uses."""
        still: list[tuple[CopyEvent, torch.Tensor]] = []
        for event, buf in self._busy:
            if event.query():
                self._free.append(buf)
            else:
                still.append((event, buf))
        self._busy = still
        numel = 1
        for n in shape:
            numel *= n
        for i, buf in enumerate(self._free):
            if buf.dtype == dtype and buf.numel() >= numel:
                del self._free[i]
                return buf[:numel].view(shape)
        self.allocated += 1
        size = 1 << max(numel - 1, 0).bit_length()
        return torch.empty(size, dtype=dtype, pin_memory=self.pin)[:numel].view(shape)

    def release(self, view: torch.Tensor, event: CopyEvent) -> None:
        """``view`` (from :meth:`take`) is free once ``event`` has completed."""
        base = view._base if view._base is not None else view
        self._busy.append((event, base))


@dataclass
class PendingScatter:
    """A demotion's rows in pinned staging, to be written into the L2 slots once copied."""

    event: CopyEvent
    staged: list[torch.Tensor]  # one [rows..., pages, ...] view per page tensor
    targets: list[torch.Tensor]  # the host pool's page tensors
    slots: torch.Tensor  # the L2 slots (host int64)

    def finish(self, staging: PinnedStaging) -> None:
        self.event.synchronize()
        for rows, dst in zip(self.staged, self.targets):
            dst.index_copy_(1, self.slots, rows)
            staging.release(rows, DoneEvent())
