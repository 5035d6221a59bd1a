"""The router's memory releases (router/memory_ops.py), over a worker pool whose socket
records what it sent: every live worker is asked for the tags named (all without any); the
client's answer says whether they all released them, what is released now and the bytes
given back; a worker that joins while the others sleep is released before anything else
reaches it, and not once they are awake; a worker that joins with memory released (the
router restarted) makes the release the router's; a refused release leaves the router's view
as the workers answered it, and a dead or silent worker fails the operation."""

from __future__ import annotations

import time

from fan_out_router import FanOutRouter

import radixserve.serving.wire.protocol as p
from radixserve.serving.router.memory_ops import MemoryOps

ALL: list[p.MemoryTag] = ["kv_cache", "weights"]
MIB = 1 << 20


def _router() -> FanOutRouter[MemoryOps]:
    return FanOutRouter(MemoryOps)


def test_a_release_every_worker_takes_is_answered_and_given_to_joiners_until_resumed() -> None:
    r = _router()
    w0, w1 = r.join(0), r.join(1)
    r.sent()
    r.ops.start(b"c", p.ReleaseMemory(request_id="r"))
    assert r.sent() == [p.WorkerReleaseMemory(token=1, tags=ALL)] * 2
    r.ops.on_reply(w0, p.WorkerMemoryReply(token=1, released=ALL, freed_bytes=MIB))
    assert not r.replies and r.ops.released == []  # not until every worker answered
    r.ops.on_reply(w1, p.WorkerMemoryReply(token=1, released=ALL, freed_bytes=2 * MIB))
    assert r.replies == [p.MemoryReply(request_id="r", ok=True, released=ALL, freed_bytes=3 * MIB)]
    r.join(2)  # a worker (re)started while the others sleep
    assert r.sent() == [p.WorkerReleaseMemory(token=0, tags=ALL)]
    r.ops.start(b"c", p.ResumeMemory(request_id="w", tags=["weights"]))
    assert r.sent() == [p.WorkerResumeMemory(token=2, tags=["weights"])] * 3
    for w in r.pool.live:
        r.ops.on_reply(w, p.WorkerMemoryReply(token=2, released=["kv_cache"]))
    assert r.replies[-1] == p.MemoryReply(request_id="w", ok=True, released=["kv_cache"])
    r.ops.start(b"c", p.ResumeMemory(request_id="k"))
    for w in r.pool.live:
        r.ops.on_reply(w, p.WorkerMemoryReply(token=3))
    assert r.replies[-1] == p.MemoryReply(request_id="k", ok=True)
    r.sent()
    r.join(3)
    assert r.sent() == [] and r.ops.released == []


def test_a_refusing_dead_or_silent_worker_fails_the_release() -> None:
    r = _router()
    w0, w1 = r.join(0), r.join(1)
    r.ops.start(b"c", p.ReleaseMemory(request_id="r", tags=["kv_cache"]))
    r.ops.on_reply(w0, p.WorkerMemoryReply(token=1, error="requests are running"))
    r.ops.on_reply(w1, p.WorkerMemoryReply(token=1, error="requests are running"))
    last = r.replies[-1]
    assert (last.ok, last.code, last.released) == (False, "invalid_params", [])
    assert last.error == "worker 0: requests are running; worker 1: requests are running"
    r.ops.start(b"c", p.ReleaseMemory(request_id="r", tags=["kv_cache"]))
    r.ops.on_reply(w0, p.WorkerMemoryReply(token=2, released=["kv_cache"]))
    r.pool.mark_dead(w1, "killed")
    assert r.replies[-1].error == "worker 1 died before it answered"
    assert r.replies[-1].released == ["kv_cache"]  # what the live one answered
    r.ops.start(b"c", p.ResumeMemory(request_id="w"))
    r.ops.expire(time.monotonic() + 10)
    assert (r.replies[-1].code, r.replies[-1].error) == (
        "unavailable",
        "worker 0 did not answer within 5 s",
    )


def test_a_worker_that_joins_released_makes_the_release_the_routers() -> None:
    """A router started while its workers slept (a restart) learns what they released from
    their hellos: it reports it, releases the workers that joined awake before and after
    (and a joiner's missing tags), and a resume reaches them all."""
    r = _router()
    r.join(0)
    r.sent()
    r.join(1, memory_released=["kv_cache"])
    assert r.ops.released == ["kv_cache"]
    assert r.sent() == [p.WorkerReleaseMemory(token=0, tags=["kv_cache"])]  # worker 0
    r.join(2, memory_released=["weights"])  # more: the others release it too
    assert r.ops.released == ALL
    assert r.sent() == [p.WorkerReleaseMemory(token=0, tags=ALL)] * 3  # 0, 1, then 2's kv
    r.join(3, memory_released=ALL)
    r.join(4)
    assert r.sent() == [p.WorkerReleaseMemory(token=0, tags=ALL)]  # worker 4 only
    r.ops.start(b"c", p.ResumeMemory(request_id="w"))
    assert r.sent() == [p.WorkerResumeMemory(token=1, tags=ALL)] * 5
    for w in r.pool.live:
        r.ops.on_reply(w, p.WorkerMemoryReply(token=1))
    # Once a client has resumed through this router, a worker that missed it is left as it
    # is (its weights may need the update it missed too): nothing adopted, nothing sent.
    r.join(5, memory_released=ALL)
    assert r.sent() == [] and r.ops.released == []
