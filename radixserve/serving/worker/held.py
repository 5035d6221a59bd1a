"""The requests a worker keeps from its engine while something holds them: a weight update
waiting for the running requests to finish (worker/weight_updates.py), a pause
(worker/pausing.py). Each holder names itself; the held requests start, in the order they
came, once no holder is left. A held request the router aborts never reaches the engine:
the worker ends it at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from radixserve.serving.wire import protocol as p


class HeldRequests:
    """Requests held back from the engine (see the module docstring). ``start``: how the
    worker starts requests (called with the held ones once nothing holds them)."""

    def __init__(self, start: Callable[[list[p.WorkerRequest]], None]) -> None:
        self._start = start
        self._holders: set[str] = set()
        self._held: list[p.WorkerRequest] = []

    def __len__(self) -> int:
        return len(self._held)

    def hold_for(self, holder: str) -> None:
        """Requests that come from now on wait until ``holder`` lets go (:meth:`release`)."""
        self._holders.add(holder)

    def release(self, holder: str) -> None:
        """``holder`` lets go; with no holder left the held requests start."""
        self._holders.discard(holder)
        if self._holders or not self._held:
            return
        held, self._held = self._held, []
        self._start(held)

    def admit(self, requests: Sequence[p.WorkerRequest]) -> None:
        """Start ``requests`` now, or hold them while anything holds."""
        if self._holders:
            self._held.extend(requests)
        else:
            self._start(list(requests))

    def drop(self, rids: Sequence[str]) -> list[str]:
        """Forget the held requests of ``rids`` (aborted); the rids that were held."""
        gone = set(rids)
        dropped = [r.rid for r in self._held if r.rid in gone]
        self._held = [r for r in self._held if r.rid not in gone]
        return dropped

    def take_all(self) -> list[str]:
        """Forget every held request (aborted, or given up by the router); their rids."""
        rids = [r.rid for r in self._held]
        self._held = []
        return rids
