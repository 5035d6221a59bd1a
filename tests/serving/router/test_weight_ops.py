"""The router's weight updates (router/weight_ops.py), over a worker pool whose socket
records what it sent: every live worker is asked; the client's answer says whether they all
took the new weights, and the model info's view of each follows its reply; a worker that
joins later is sent the last update all took; a refusing, dead or silent worker fails the
update, which is then not replayed."""

from __future__ import annotations

import time

import msgspec
from recording_backend import RecordingBackend

import radixserve.serving.wire.protocol as p
from radixserve.serving.router.dispatch import Dispatcher
from radixserve.serving.router.weight_ops import WeightOps
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool

HELLO = p.WorkerHello(0, 1000, "m", 64, 32, [0], model_path="/a")
UPDATE = p.UpdateWeights(request_id="r", model_path="/b", weight_version="v2")


class _Router:
    """A WeightOps over a WorkerPool, wired as the router wires them; the replies kept."""

    def __init__(self) -> None:
        self.backend = RecordingBackend()
        self.replies: list[p.UpdateWeightsReply] = []
        self.pool = WorkerPool(
            self.backend,  # type: ignore[arg-type]
            Dispatcher(),
            on_dead=lambda w, reason: self.weights.on_worker_dead(w),
            on_joined=lambda w: self.weights.on_joined(w),
        )
        self.weights = WeightOps(self.pool, 5.0, self._reply)

    def _reply(self, client: bytes, msg: msgspec.Struct) -> bool:
        assert isinstance(msg, p.UpdateWeightsReply)
        self.replies.append(msg)
        return True

    def join(self, wid: int) -> WorkerHandle:
        return self.pool.register(f"w{wid}".encode(), msgspec.structs.replace(HELLO, worker_id=wid))

    def answer(self, w: WorkerHandle, token: int, error: str | None = None) -> None:
        path, version = ("/a", "default") if error else ("/b", "v2")
        reply = p.WorkerWeightsReply(token, error, model_path=path, weight_version=version)
        self.weights.on_reply(w, reply)


def test_an_update_every_worker_takes_is_answered_and_replayed_to_joiners() -> None:
    r = _Router()
    w0, w1 = r.join(0), r.join(1)
    r.backend.take()
    r.weights.start(b"c", UPDATE)
    sent = [m for _, m in r.backend.take()]
    assert sent == [p.WorkerUpdateWeights(token=1, path="/b", weight_version="v2")] * 2
    r.answer(w0, 1)
    assert not r.replies and (w0.weight_version, w1.weight_version) == ("v2", "default")
    r.answer(w1, 1)
    assert r.replies == [
        p.UpdateWeightsReply(request_id="r", ok=True, model_path="/b", weight_version="v2")
    ]
    r.join(2)  # a worker (re)started from its flags
    assert [m for _, m in r.backend.take()] == [
        p.WorkerUpdateWeights(token=0, path="/b", weight_version="v2")
    ]


def test_a_refusing_dead_or_silent_worker_fails_the_update() -> None:
    r = _Router()
    w0, w1 = r.join(0), r.join(1)
    r.weights.start(b"c", UPDATE)
    r.answer(w0, 1)
    r.answer(w1, 1, error="num_layers 2 -> 3")
    assert not r.replies[-1].ok and r.replies[-1].code == "invalid_params"
    assert r.replies[-1].error == "worker 1: num_layers 2 -> 3"
    r.weights.start(b"c", UPDATE)
    r.answer(w0, 2)
    r.pool.mark_dead(w1, "killed")
    assert r.replies[-1].error == "worker 1 died before it answered"
    r.weights.start(b"c", UPDATE)
    r.weights.expire(time.monotonic() + 10)
    assert r.replies[-1].code == "unavailable"
    assert r.replies[-1].error == "worker 0 did not answer within 5 s"
    r.backend.take()
    r.join(3)
    assert r.backend.take() == [], "a failed update is not replayed"
    r.pool.mark_dead(w0, "killed")
    r.pool.mark_dead(r.pool.workers[3], "killed")
    r.weights.start(b"c", UPDATE)
    assert r.replies[-1] == p.UpdateWeightsReply(
        request_id="r", ok=False, code="unavailable", error="no live worker"
    )
