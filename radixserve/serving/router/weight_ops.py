"""Updating every worker's weights while serving (SGLang's ``/update_weights_from_disk``).

A client's :class:`~radixserve.serving.wire.protocol.UpdateWeights` fans out to the live
workers with a token. Each finishes the requests it runs, holds the ones that come
meanwhile, loads the checkpoint and answers with what it serves now (its model path and
weight version: the router's view of it, which ``ModelInfo`` reports). The reply goes back
when every one answered, died, or the timeout passed, ``ok`` when every worker that
answered took the new weights.

A worker that joins later (a restart starts from its ``--model``) is sent the last update
every worker took before any request can reach it; its hold keeps the requests that
follow for the new weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from radixserve.serving.router.fan_out import ReportedOp, ReportingFanOut
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool
from radixserve.serving.wire import protocol as p

log = logging.getLogger("radixserve.serving.router")


@dataclass(eq=False)
class _Op(ReportedOp):
    msg: p.UpdateWeights
    answered: list[WorkerHandle] = field(default_factory=list)


class WeightOps(ReportingFanOut[_Op, WorkerPool]):
    """Fan-out / fan-in of weight updates for one router, and their replay to workers that
    join (see the module docstring)."""

    def __init__(
        self,
        pool: WorkerPool,
        timeout_s: float,
        send_client: Callable[[bytes, msgspec.Struct], bool],
    ) -> None:
        super().__init__(pool, timeout_s, send_client)
        self._last: p.WorkerUpdateWeights | None = None  # replayed to joining workers

    def start(self, client: bytes, msg: p.UpdateWeights) -> None:
        op = _Op(client, set(), self._deadline(), msg)
        token = self._ask_live(
            op,
            lambda t: p.WorkerUpdateWeights(
                token=t, path=msg.model_path, weight_version=msg.weight_version
            ),
        )
        self._maybe_done(token)

    def on_reply(self, w: WorkerHandle, msg: p.WorkerWeightsReply) -> None:
        w.model_path, w.weight_version = msg.model_path, msg.weight_version
        if msg.token == 0 and msg.error is not None:
            log.warning("worker %d: replaying a weight update failed: %s", w.worker_id, msg.error)
        op = self._ops.get(msg.token)
        if op is None or w.worker_id not in op.waiting:
            return
        op.waiting.discard(w.worker_id)
        op.answered.append(w)
        if msg.error is not None:
            op.errors.append(f"worker {w.worker_id}: {msg.error}")
        self._maybe_done(msg.token)

    def on_joined(self, w: WorkerHandle) -> None:
        """Send a joining worker the last update every worker took."""
        if self._last is not None:
            self._pool.send(w, self._last)

    def _finish(self, op: _Op) -> None:
        updated = [w for w in op.answered if w.alive]
        now = updated[0] if updated else None
        code = None
        if not op.answered:
            code, op.errors = "unavailable", op.errors or ["no live worker"]
        elif op.errors:
            code = "invalid_params"
        elif now is not None:  # what a worker that joins later is sent
            self._last = p.WorkerUpdateWeights(
                token=0, path=op.msg.model_path, weight_version=now.weight_version
            )
        reply = p.UpdateWeightsReply(
            request_id=op.msg.request_id,
            ok=code is None,
            code=code,
            error="; ".join(op.errors) or None,
            model_path=now.model_path if now is not None else "",
            weight_version=now.weight_version if now is not None else "default",
        )
        self._send_client(op.client, reply)
