"""The router's pauses (router/pause_ops.py), over a worker pool whose socket records what
it sent: every live worker is asked; the client's answer says whether they all paused and
how many running requests the pause stopped; a worker that joins while paused is paused
before anything else reaches it, and not once generation continues; a worker that joins
paused (the router restarted) makes its pause the router's; a refusing, dead or silent
worker fails the pause, which stays asked."""

from __future__ import annotations

import time

from fan_out_router import FanOutRouter

import radixserve.serving.wire.protocol as p
from radixserve.serving.router.pause_ops import PauseOps

PAUSE = p.PauseGeneration(request_id="r", mode="retract")


def _router() -> FanOutRouter[PauseOps]:
    return FanOutRouter(PauseOps)


def test_a_pause_every_worker_takes_is_answered_and_given_to_joiners_until_the_continue() -> None:
    r = _router()
    w0, w1 = r.join(0), r.join(1)
    r.sent()
    r.ops.start(b"c", PAUSE)
    assert r.sent() == [p.WorkerPause(token=1, mode="retract")] * 2
    r.ops.on_reply(w0, p.WorkerPauseReply(token=1, paused=True, stopped=2))
    assert not r.replies and r.ops.mode == "retract"
    r.ops.on_reply(w1, p.WorkerPauseReply(token=1, paused=True, stopped=1))
    assert r.replies == [p.PauseReply(request_id="r", ok=True, paused=True, stopped=3)]
    r.join(2)  # a worker (re)started while the others are paused
    assert r.sent() == [p.WorkerPause(token=0, mode="in_place")]
    r.ops.start(b"c", p.ContinueGeneration(request_id="c"))
    assert r.sent() == [p.WorkerContinue(token=2)] * 3
    for w in r.pool.live:
        r.ops.on_reply(w, p.WorkerPauseReply(token=2))
    assert r.replies[-1] == p.PauseReply(request_id="c", ok=True, paused=False)
    r.join(3)
    assert r.sent() == [] and r.ops.mode is None


def test_a_refusing_dead_or_silent_worker_fails_the_pause() -> None:
    r = _router()
    w0, w1 = r.join(0), r.join(1)
    r.ops.start(b"c", PAUSE)
    r.ops.on_reply(w0, p.WorkerPauseReply(token=1, paused=True))
    r.ops.on_reply(w1, p.WorkerPauseReply(token=1, error="cannot retract"))
    assert r.replies[-1].code == "invalid_params" and r.replies[-1].paused
    assert r.replies[-1].error == "worker 1: cannot retract"
    r.ops.start(b"c", PAUSE)
    r.ops.on_reply(w0, p.WorkerPauseReply(token=2, paused=True))
    r.pool.mark_dead(w1, "killed")
    assert r.replies[-1].error == "worker 1 died before it answered"
    r.ops.start(b"c", PAUSE)
    r.ops.expire(time.monotonic() + 10)
    assert (r.replies[-1].code, r.replies[-1].error) == (
        "unavailable",
        "worker 0 did not answer within 5 s",
    )


def test_a_worker_that_joins_paused_makes_the_pause_the_routers() -> None:
    """A router started while its workers were paused (a restart) learns the pause from the
    first hello that says so: it reports it, pauses the workers that joined unpaused before
    and after, and a continue reaches them all."""
    r = _router()
    r.join(0)
    r.sent()
    r.join(1, paused="retract")
    assert r.ops.mode == "retract" and r.sent() == [p.WorkerPause(token=0, mode="in_place")]
    r.join(2, paused="in_place")  # paused already: nothing to send
    r.join(3)
    assert r.sent() == [p.WorkerPause(token=0, mode="in_place")] and r.ops.mode == "retract"
    r.ops.start(b"c", p.ContinueGeneration(request_id="c"))
    assert r.sent() == [p.WorkerContinue(token=1)] * 4 and r.ops.mode is None
    # Once a client has continued through this router, a worker that missed it (cut off
    # meanwhile, paused still) is continued: the router's state is the clients' word.
    r.join(5, paused="retract")
    assert r.sent() == [p.WorkerContinue(token=0)] and r.ops.mode is None
