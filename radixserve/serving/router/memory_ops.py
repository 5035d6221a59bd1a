"""Every worker's memory released and resumed (SGLang's ``/release_memory_occupation`` and
``/resume_memory_occupation``, vLLM's ``/sleep`` and ``/wake_up``).

A client's :class:`~radixserve.serving.wire.protocol.ReleaseMemory` fans out to the live
workers as :class:`~radixserve.serving.wire.protocol.WorkerReleaseMemory`; each gives the
memory back, holds the requests that come, and answers with what it has released now
(worker/sleeping.py). The reply goes back when every one answered, died or the timeout
passed, ``ok`` when none refused. :class:`~radixserve.serving.wire.protocol.ResumeMemory`
goes the same way.

What the workers answered they have released is what the router reports
(``released``, ``ModelInfo.memory_released``: asleep while any tag is): a refused release
(a request running) leaves it as it was. A worker that joins while the others sleep is
released too before any request reaches it, and so holds the requests that follow; one that
joins with memory released (``WorkerHello.memory_released``: the router restarted since)
makes the release the router's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from radixserve.serving.router.fan_out import ReportedOp, ReportingFanOut
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool
from radixserve.serving.wire import protocol as p

log = logging.getLogger("radixserve.serving.router")


@dataclass(eq=False)
class _Op(ReportedOp):
    request_id: str
    released: set[str] = field(default_factory=set)  # what the answering workers hold released
    freed_bytes: int = 0


class MemoryOps(ReportingFanOut[_Op, WorkerPool]):
    """Fan-out / fan-in of memory releases and resumes for one router (see the module
    docstring)."""

    _released: frozenset[str] = frozenset()
    asked = False  # a client released or resumed through this router (its state is theirs)

    @property
    def released(self) -> list[p.MemoryTag]:
        """The tags the workers hold released, in ``MEMORY_TAGS``' order (empty: awake)."""
        return [t for t in p.MEMORY_TAGS if t in self._released]

    def start(self, client: bytes, msg: p.ReleaseMemory | p.ResumeMemory) -> None:
        self.asked = True
        op = _Op(client, set(), self._deadline(), request_id=msg.request_id)
        tags = [t for t in p.MEMORY_TAGS if msg.tags is None or t in msg.tags]
        if isinstance(msg, p.ReleaseMemory):
            token = self._ask_live(op, lambda t: p.WorkerReleaseMemory(token=t, tags=tags))
        else:
            token = self._ask_live(op, lambda t: p.WorkerResumeMemory(token=t, tags=tags))
        self._maybe_done(token)

    def on_reply(self, w: WorkerHandle, msg: p.WorkerMemoryReply) -> None:
        if msg.token == 0 and msg.error is not None:
            log.warning(
                "worker %d: releasing its memory as it joined failed: %s", w.worker_id, msg.error
            )
        op = self._answered(w, msg.token, msg.error)
        if op is not None:
            op.released.update(msg.released)
            op.freed_bytes += msg.freed_bytes
            self._maybe_done(msg.token)

    def on_joined(self, w: WorkerHandle) -> None:
        """Release a worker that joins while the others sleep: it runs nothing yet.

        A worker that joins with memory released that this router does not know of keeps it
        released; if no client has released or resumed through this router (it started
        since: a restart) the router takes its tags as released too and gives the other
        live workers the same release: a client (an RL trainer) gave that memory to
        something else, and only its resume takes it back. Where one has, the worker missed
        a resume: it is left as it is (its weights, if released, need the update it missed
        too) and said so."""
        joined = set(w.hello.memory_released)
        if joined - self._released and self.asked:
            log.warning(
                "worker %d joined with %s released after a resume it missed: resume it (and "
                "update its weights) to serve from it",
                w.worker_id,
                sorted(joined - self._released),
            )
        elif joined - self._released:
            self._released = self._released | joined
            log.info(
                "worker %d joined with %s released: releasing the others",
                w.worker_id,
                sorted(joined),
            )
            for other in self._pool.live:
                if other is not w:
                    self._pool.send(other, p.WorkerReleaseMemory(token=0, tags=self.released))
        if self._released - joined:
            self._pool.send(w, p.WorkerReleaseMemory(token=0, tags=self.released))

    def _finish(self, op: _Op) -> None:
        code = self._code(op)
        if op.replies:
            self._released = frozenset(op.released)
        reply = p.MemoryReply(
            request_id=op.request_id,
            ok=code is None,
            code=code,
            error="; ".join(op.errors) or None,
            released=self.released,
            freed_bytes=op.freed_bytes,
        )
        self._send_client(op.client, reply)
