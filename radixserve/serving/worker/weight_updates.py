"""A worker's weight updates (SGLang's ``update_weights_from_disk``), applied between
requests: the requests running when one arrives finish with the weights they started with,
and the requests that arrive meanwhile wait, then run with the new weights.

An update waits in order with any before it until the engine has nothing running or
waiting (while the worker is paused, until nothing holds KV: requests retracted by the
pause wait, and run with the new weights); then the engine loads the checkpoint and copies
it in (``Engine.update_weights_from_disk``, seconds of the loop with nothing to run), the
router is answered with what the worker serves now, and the held requests
(worker/held.py) start. An engine without ``update_weights_from_disk`` (the tests' fake
engines) refuses every update.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from radixserve.serving.wire import protocol as p
from radixserve.serving.worker.held import HeldRequests

log = logging.getLogger("radixserve.serving.worker")


class WeightUpdates:
    """The pending weight updates of one worker (see the module docstring). ``held``: the
    worker's held requests, which an update holds while it waits. ``ready``: whether an
    update may apply now (default: the engine has nothing running or waiting);
    ``refusal``: why an update that comes now is refused at once (None: it waits its turn),
    as while a pause keeps requests in place with KV of the weights served."""

    HOLDER = "weights"

    def __init__(
        self,
        engine: Any,
        send: Callable[[msgspec.Struct], None],
        held: HeldRequests,
        ready: Callable[[], bool] | None = None,
        refusal: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._engine, self._send, self._held = engine, send, held
        self._ready = ready if ready is not None else lambda: not engine.has_unfinished()
        self._refusal = refusal
        self._queue: deque[p.WorkerUpdateWeights] = deque()

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def submit(self, msg: p.WorkerUpdateWeights) -> None:
        refused = self._refusal()
        if refused is not None:
            self._reply(msg, refused)
            return
        self._queue.append(msg)
        self._held.hold_for(self.HOLDER)
        self.apply_ready()

    def apply_ready(self) -> None:
        """Between steps: once nothing runs, apply the waiting updates in order, answer each,
        then start the requests they held."""
        if not self._queue or not self._ready():
            return
        while self._queue:
            self._apply(self._queue.popleft())
        self._held.release(self.HOLDER)

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
        self._reply(msg, error)

    def _reply(self, msg: p.WorkerUpdateWeights, error: str | None) -> None:
        path = str(getattr(self._engine, "model_path", "") or "")
        self._send(
            p.WorkerWeightsReply(
                token=msg.token, error=error, model_path=path, weight_version=self._version()
            )
        )

    def _version(self) -> str:
        return str(getattr(self._engine, "weight_version", "default"))
