"""A worker's pause and continue, in each mode, on the real worker loop: a request kept in
place makes no progress until the continue (checked by round trips of the loop, not by
time), one retracted waits out a weight update and the requests sent meanwhile run with the
new weights, an abort ends the running and the held ones, a ``wait`` answers only once its
requests finished; a weight update while requests are kept in place is refused at once.

The real worker loop runs in a thread around the fake engine, slowed to 20 ms a step so
that a request is still running when the messages after it arrive."""

from __future__ import annotations

from typing import Any

import pytest
from test_weight_updates import UpdatableEngine
from worker_harness import Wired, add, wired_worker

from radixserve.engine.outputs import StepOutput
from radixserve.serving.wire import protocol as p
from radixserve.serving.worker.pausing import IN_PLACE_HOLDS_KV

pytestmark = pytest.mark.timeout(60)


class PausableEngine(UpdatableEngine):
    """The fake engine with the real one's pause hooks: retracted requests wait (they hold
    no KV) and run on at the next step; an aborted request leaves at once, its end
    reported without a step."""

    def __init__(self) -> None:
        super().__init__()
        self.retracted: set[str] = set()
        self._ended: list[StepOutput] = []

    def settle(self) -> None:
        pass  # the fake launches no step ahead

    def retract_running(self) -> int:
        running = set(self._reqs) - self.retracted
        self.retracted |= running
        return len(running)

    def has_running(self) -> bool:
        return bool(set(self._reqs) - self.retracted)

    def abort(self, request_id: str) -> None:
        if request_id in self._reqs:
            self._finish(self._reqs[request_id])
            self._ended.append(StepOutput(request_id, [], finished=True, finish_reason="abort"))

    def has_unfinished(self) -> bool:
        return bool(self._ended) or super().has_unfinished()

    def step(self) -> list[StepOutput]:
        self.retracted.clear()  # they run again
        return self.take_outputs() + super().step()

    def take_outputs(self) -> list[StepOutput]:
        out, self._ended = self._ended, []
        return out

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
        assert not self.has_running(), "updated while requests hold KV"
        if path == "missing":
            raise ValueError(f"no checkpoint at {path}")
        self.model_path, self.weight_version = path, weight_version or self.weight_version


def _first_token(w: Wired, rid: str) -> None:
    while not any(o.request_id == rid for o in w.next(p.WorkerOutputs).outputs):
        pass


def _ends(w: Wired, rids: set[str]) -> dict[str, str | None]:
    """The finish reason of each of ``rids``, as they end."""
    ends: dict[str, str | None] = {}
    while not rids <= set(ends):
        ends |= {
            o.request_id: o.finish_reason for o in w.next(p.WorkerOutputs).outputs if o.finished
        }
    return ends


def _until(w: Wired, last: Any) -> list[Any]:
    """Every message the worker sends, up to the first that ``last`` accepts."""
    seen = [w.recv()]
    while not last(seen[-1]):
        seen.append(w.recv())
    return seen


def _round_trips(w: Wired, n: int) -> None:
    """``n`` pings answered: the loop went round at least ``n`` times."""
    for _ in range(n):
        w.send(p.WorkerPing())
        w.next(p.WorkerHeartbeat)


def test_in_place_keeps_a_request_still_and_refuses_weights_until_the_continue() -> None:
    engine = PausableEngine()
    with wired_worker(engine) as w:
        w.send(add("kept", tokens=30))
        _first_token(w, "kept")
        w.send(p.WorkerPause(token=1, mode="in_place"))
        assert w.next(p.WorkerPauseReply) == p.WorkerPauseReply(token=1, paused=True)
        made = len(engine._reqs["kept"].out)
        w.send(add("held", tokens=2), p.WorkerUpdateWeights(token=2, path="/b"))
        reply = w.next(p.WorkerWeightsReply)
        assert (reply.token, reply.error, reply.model_path) == (2, IN_PLACE_HOLDS_KV, "/a")
        _round_trips(w, 5)
        assert len(engine._reqs["kept"].out) == made and "held" not in engine._reqs
        w.send(p.WorkerContinue(token=3))
        assert w.next(p.WorkerPauseReply) == p.WorkerPauseReply(token=3, paused=False)
        assert _ends(w, {"kept", "held"}) == {"kept": "length", "held": "length"}


def test_retracted_requests_wait_out_a_weight_update_and_later_ones_get_it() -> None:
    engine = PausableEngine()
    with wired_worker(engine) as w:
        w.send(add("rollout", tokens=30))
        _first_token(w, "rollout")
        w.send(p.WorkerPause(token=1, mode="retract"))
        assert w.next(p.WorkerPauseReply) == p.WorkerPauseReply(token=1, paused=True, stopped=1)
        w.send(
            add("next", tokens=2), p.WorkerUpdateWeights(token=2, path="/b", weight_version="v2")
        )
        reply = w.next(p.WorkerWeightsReply)
        assert (reply.error, reply.weight_version) == (None, "v2")  # applied while paused
        assert "next" not in engine._reqs
        w.send(p.WorkerContinue(token=3))
        assert _ends(w, {"rollout", "next"}) == {"rollout": "length", "next": "length"}
    assert engine.added_under == {"rollout": "default", "next": "v2"}


def test_abort_ends_the_running_and_the_held_and_later_ones_wait() -> None:
    engine = PausableEngine()
    with wired_worker(engine) as w:
        w.send(add("running", tokens=30), p.WorkerUpdateWeights(token=1, path="missing"))
        w.send(add("held", tokens=2))  # held by the update waiting for "running"
        _first_token(w, "running")
        w.send(p.WorkerPause(token=2, mode="abort", clear_cache=True))
        seen = _until(w, lambda m: isinstance(m, p.WorkerWeightsReply))
        ends = {
            o.request_id: o.finish_reason
            for m in seen
            if isinstance(m, p.WorkerOutputs)
            for o in m.outputs
        }
        assert ends == {"running": "abort", "held": "abort"}
        replies = [m for m in seen if isinstance(m, (p.WorkerPauseReply, p.WorkerWeightsReply))]
        assert replies[0] == p.WorkerPauseReply(token=2, paused=True, stopped=1)
        assert replies[1].error == "no checkpoint at missing"  # it applied once paused
        assert engine.stats().pages_evictable == 0  # the cache was cleared
        w.send(add("later", tokens=2), p.WorkerAbort(rids=["later"]))
        assert _ends(w, {"later"}) == {"later": "abort"}  # held, then aborted: it ends at once
        w.send(add("after", tokens=2), p.WorkerContinue(token=3))
        assert w.next(p.WorkerPauseReply).paused is False
        assert _ends(w, {"after"}) == {"after": "length"}


def test_wait_answers_once_its_requests_finished() -> None:
    engine = PausableEngine()
    with wired_worker(engine) as w:
        w.send(add("finishing", tokens=8), p.WorkerPause(token=1, mode="wait"), add("held"))
        seen = _until(w, lambda m: isinstance(m, p.WorkerPauseReply))
        ended = [
            o.request_id
            for m in seen
            if isinstance(m, p.WorkerOutputs)
            for o in m.outputs
            if o.finished
        ]
        assert ended == ["finishing"] and seen[-1] == p.WorkerPauseReply(token=1, paused=True)
        assert "held" not in engine._reqs
        w.send(p.WorkerContinue(token=2))
        assert _ends(w, {"held"}) == {"held": "length"}


def test_a_continue_ends_a_wait_still_draining() -> None:
    engine = PausableEngine()
    with wired_worker(engine) as w:
        w.send(
            add("long", tokens=40), p.WorkerPause(token=1, mode="wait"), p.WorkerContinue(token=2)
        )
        first, second = w.next(p.WorkerPauseReply), w.next(p.WorkerPauseReply)
        assert (first.token, first.error) == (1, "continued before the running requests finished")
        assert (second.token, second.paused, second.error) == (2, False, None)
        assert _ends(w, {"long"}) == {"long": "length"}


def test_refused_where_a_pause_cannot_hold() -> None:
    """With prefill/decode disaggregation (peers on other workers wait on this one's
    transfers), and ``retract`` on an engine that cannot retract: an error, nothing held."""
    from radixserve.serving.worker.held import HeldRequests
    from radixserve.serving.worker.pausing import Pausing

    sent: list[Any] = []
    started: list[Any] = []
    held = HeldRequests(started.extend)
    engine = UpdatableEngine()  # no retract_running
    disagg = Pausing(engine, sent.append, held, lambda: 0, disaggregated=True)
    disagg.pause(p.WorkerPause(token=1, mode="in_place"))
    plain = Pausing(engine, sent.append, held, lambda: 0)
    plain.pause(p.WorkerPause(token=2, mode="retract"))
    assert [(m.token, m.paused, m.error) for m in sent] == [
        (1, False, "pausing is not supported with prefill/decode disaggregation"),
        (2, False, "this worker's engine cannot retract its requests"),
    ]
    held.admit([add("r").requests[0]])
    assert [r.rid for r in started] == ["r"]  # nothing holds
