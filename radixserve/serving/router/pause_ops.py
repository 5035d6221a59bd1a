"""Pausing every worker's generation and continuing it (SGLang's ``/pause_generation`` and
``/continue_generation``, vLLM's ``/pause`` and ``/resume``).

A client's :class:`~radixserve.serving.wire.protocol.PauseGeneration` fans out to the live
workers as :class:`~radixserve.serving.wire.protocol.WorkerPause`; each does what its mode
says with its running requests, holds the ones that come, and answers
(worker/pausing.py). The reply goes back when every one answered, died or the timeout
passed, ``ok`` when none refused. :class:`~radixserve.serving.wire.protocol.ContinueGeneration`
goes the same way.

The router remembers the pause in force from the moment it is asked (``mode``, which
``ModelInfo.paused`` reports): a worker that joins meanwhile is paused before any request
reaches it, and so holds the requests that follow, as the others do. A worker that joins
paused (``WorkerHello.paused``: the router restarted since) makes the pause the router's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from radixserve.serving.router.fan_out import ReportedOp, ReportingFanOut
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool
from radixserve.serving.wire import protocol as p

log = logging.getLogger("radixserve.serving.router")


@dataclass(eq=False)
class _Op(ReportedOp):
    request_id: str
    stopped: int = 0


class PauseOps(ReportingFanOut[_Op, WorkerPool]):
    """Fan-out / fan-in of pauses and continues for one router (see the module docstring)."""

    mode: p.PauseMode | None = None  # the pause in force; None: generating
    asked = False  # a client paused or continued through this router (its state is theirs)

    def start(self, client: bytes, msg: p.PauseGeneration | p.ContinueGeneration) -> None:
        self.asked = True
        op = _Op(client, set(), self._deadline(), request_id=msg.request_id)
        if isinstance(msg, p.PauseGeneration):
            self.mode = msg.mode
            token = self._ask_live(
                op, lambda t: p.WorkerPause(token=t, mode=msg.mode, clear_cache=msg.clear_cache)
            )
        else:
            self.mode = None
            token = self._ask_live(op, lambda t: p.WorkerContinue(token=t))
        self._maybe_done(token)

    def on_reply(self, w: WorkerHandle, msg: p.WorkerPauseReply) -> None:
        if msg.token == 0 and msg.error is not None:
            log.warning("worker %d: pausing it as it joined failed: %s", w.worker_id, msg.error)
        op = self._answered(w, msg.token, msg.error)
        if op is not None:
            op.stopped += msg.stopped
            self._maybe_done(msg.token)

    def on_joined(self, w: WorkerHandle) -> None:
        """Pause a worker that joins while the others are paused: it runs nothing yet, so
        in place is every mode's effect there (the requests that come are held).

        A worker that joins paused where this router knows no pause keeps its pause if no
        client has paused or continued through this router (it started since: a restart),
        which the router then takes as its own and gives the other live workers, in place
        (their running requests stay, held): a client paused them all, and only its continue
        ends that. Where one has, the router's state is the clients' latest word: the worker
        (which missed a continue) is continued."""
        if self.mode is None and w.hello.paused is not None and self.asked:
            log.info(
                "worker %d joined paused after a continue it missed: continuing it", w.worker_id
            )
            self._pool.send(w, p.WorkerContinue(token=0))
        elif self.mode is None and w.hello.paused is not None:
            self.mode = w.hello.paused
            log.info("worker %d joined paused (%s): pausing the others", w.worker_id, self.mode)
            for other in self._pool.live:
                if other is not w:
                    self._pool.send(other, p.WorkerPause(token=0, mode="in_place"))
        elif self.mode is not None and w.hello.paused is None:
            self._pool.send(w, p.WorkerPause(token=0, mode="in_place"))

    def _finish(self, op: _Op) -> None:
        code = self._code(op)
        reply = p.PauseReply(
            request_id=op.request_id,
            ok=code is None,
            code=code,
            error="; ".join(op.errors) or None,
            paused=self.mode is not None,
            stopped=op.stopped,
        )
        self._send_client(op.client, reply)
