"""The router's pauses (router/pause_ops.py), over a worker pool whose socket records what
it sent: every live worker is asked; the client's answer says whether they all paused and
how many running requests the pause stopped; a worker that joins while paused is paused
before anything else reaches it, and not once generation continues; a refusing, dead or
silent worker fails the pause, which stays asked."""

from __future__ import annotations

import time

import msgspec
from recording_backend import RecordingBackend

import radixserve.serving.wire.protocol as p
from radixserve.serving.router.dispatch import Dispatcher
from radixserve.serving.router.pause_ops import PauseOps
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool

HELLO = p.WorkerHello(0, 1000, "m", 64, 32, [0])
PAUSE = p.PauseGeneration(request_id="r", mode="retract")


class _Router:
    """A PauseOps over a WorkerPool, wired as the router wires them; the replies kept."""

    def __init__(self) -> None:
        self.backend = RecordingBackend()
        self.replies: list[p.PauseReply] = []
        self.pool = WorkerPool(
            self.backend,  # type: ignore[arg-type]
            Dispatcher(),
            on_dead=lambda w, reason: self.pauses.on_worker_dead(w),
            on_joined=lambda w: self.pauses.on_joined(w),
        )
        self.pauses = PauseOps(self.pool, 5.0, self._reply)

    def _reply(self, client: bytes, msg: msgspec.Struct) -> bool:
        assert isinstance(msg, p.PauseReply)
        self.replies.append(msg)
        return True

    def join(self, wid: int) -> WorkerHandle:
        return self.pool.register(f"w{wid}".encode(), msgspec.structs.replace(HELLO, worker_id=wid))

    def sent(self) -> list[msgspec.Struct]:
        return [m for _, m in self.backend.take()]


def test_a_pause_every_worker_takes_is_answered_and_given_to_joiners_until_the_continue() -> None:
    r = _Router()
    w0, w1 = r.join(0), r.join(1)
    r.sent()
    r.pauses.start(b"c", PAUSE)
    assert r.sent() == [p.WorkerPause(token=1, mode="retract")] * 2
    r.pauses.on_reply(w0, p.WorkerPauseReply(token=1, paused=True, stopped=2))
    assert not r.replies and r.pauses.mode == "retract"
    r.pauses.on_reply(w1, p.WorkerPauseReply(token=1, paused=True, stopped=1))
    assert r.replies == [p.PauseReply(request_id="r", ok=True, paused=True, stopped=3)]
    r.join(2)  # a worker (re)started while the others are paused
    assert r.sent() == [p.WorkerPause(token=0, mode="in_place")]
    r.pauses.start(b"c", p.ContinueGeneration(request_id="c"))
    assert r.sent() == [p.WorkerContinue(token=2)] * 3
    for w in r.pool.live:
        r.pauses.on_reply(w, p.WorkerPauseReply(token=2))  # type: ignore[arg-type]
    assert r.replies[-1] == p.PauseReply(request_id="c", ok=True, paused=False)
    r.join(3)
    assert r.sent() == [] and r.pauses.mode is None


def test_a_refusing_dead_or_silent_worker_fails_the_pause() -> None:
    r = _Router()
    w0, w1 = r.join(0), r.join(1)
    r.pauses.start(b"c", PAUSE)
    r.pauses.on_reply(w0, p.WorkerPauseReply(token=1, paused=True))
    r.pauses.on_reply(w1, p.WorkerPauseReply(token=1, error="cannot retract"))
    assert r.replies[-1].code == "invalid_params" and r.replies[-1].paused
    assert r.replies[-1].error == "worker 1: cannot retract"
    r.pauses.start(b"c", PAUSE)
    r.pauses.on_reply(w0, p.WorkerPauseReply(token=2, paused=True))
    r.pool.mark_dead(w1, "killed")
    assert r.replies[-1].error == "worker 1 died before it answered"
    r.pauses.start(b"c", PAUSE)
    r.pauses.expire(time.monotonic() + 10)
    assert (r.replies[-1].code, r.replies[-1].error) == (
        "unavailable",
        "worker 0 did not answer within 5 s",
    )
