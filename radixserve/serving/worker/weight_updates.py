"""A worker's weight updates (SGLang's ``update_weights_from_disk``), applied between
requests: the requests running when one arrives finish with the weights they started with,
and the requests that arrive meanwhile wait, then run with the new weights.

An update waits in order with any before it until the engine has nothing running or
waiting; then the engine loads the checkpoint and copies it in
(``Engine.update_weights_from_disk``, seconds of the loop with nothing to run), the router
is answered with what the worker serves now, and the held requests start. A held request
the router aborts ends at once as aborted (the router settles it on that output). An
engine without ``update_weights_from_disk`` (the tests' fake engines) refuses every update.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from radixserve.serving.wire import protocol as p

log = logging.getLogger("radixserve.serving.worker")


class WeightUpdates:
    """The pending weight updates of one worker and the requests they hold (see the module
    docstring). ``start``: how the worker starts requests (called with the held ones)."""

    def __init__(
        self,
        engine: Any,
        send: Callable[[msgspec.Struct], None],
        start: Callable[[list[p.WorkerRequest]], None],
    ) -> None:
        self._engine, self._send, self._start = engine, send, start
        self._queue: deque[p.WorkerUpdateWeights] = deque()
        self._held: list[p.WorkerRequest] = []

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def submit(self, msg: p.WorkerUpdateWeights) -> None:
        self._queue.append(msg)
        self.apply_ready()

    def hold(self, requests: Sequence[p.WorkerRequest]) -> list[p.WorkerRequest]:
        """The requests to start now: none while an update waits (they are held)."""
        if not self._queue:
            return list(requests)
        self._held.extend(requests)
        return []

    def drop(self, rids: Sequence[str]) -> list[str]:
        """Forget the held requests of ``rids`` (aborted); the rids that were held."""
        gone = set(rids)
        dropped = [r.rid for r in self._held if r.rid in gone]
        self._held = [r for r in self._held if r.rid not in gone]
        return dropped

    def drop_all(self) -> None:
        """Forget every held request (the router gave them up)."""
        self._held.clear()

    def apply_ready(self) -> None:
        """Between steps: once nothing runs, apply the waiting updates in order, answer each,
        then start the requests they held."""
        if not self._queue or self._engine.has_unfinished():
            return
        while self._queue:
            self._apply(self._queue.popleft())
        held, self._held = self._held, []
        if held:
            self._start(held)

    def _apply(self, msg: p.WorkerUpdateWeights) -> None:
        error: str | None = None
        try:
            update = getattr(self._engine, "update_weights_from_disk", None)
            if update is None:
                raise ValueError("this worker's engine does not update its weights")
            update(msg.path, msg.weight_version)
            log.info("weights updated from %s (%s)", msg.path, self._version())
        except Exception as exc:  # an operator's bad path must not take the worker down
            error = str(exc) or type(exc).__name__
            log.warning("weight update from %s failed: %s", msg.path, error)
        path = str(getattr(self._engine, "model_path", "") or "")
        self._send(
            p.WorkerWeightsReply(
                token=msg.token, error=error, model_path=path, weight_version=self._version()
            )
        )

    def _version(self) -> str:
        return str(getattr(self._engine, "weight_version", "default"))
