"""A worker's memory released and resumed, on the real worker loop: a release while a
request runs is refused and the request finishes; once released no step runs, the requests
that come are held until the last tag is resumed, a weight update applies meanwhile (but not
while the weights themselves are released), and a request retracted by a pause waits it
all out; a worker whose engine cannot release memory says so.

The real worker loop runs in a thread around the fake engine of the pause tests, given the
real engine's release rules (refused while a request holds KV; no step, no weight update
while the weights are released)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from test_pausing import PausableEngine, _ends, _first_token, _round_trips
from worker_harness import FakeEngine, add, wired_worker

from radixserve.engine.outputs import StepOutput
from radixserve.serving.wire import protocol as p

pytestmark = pytest.mark.timeout(60)
ALL: list[p.MemoryTag] = ["kv_cache", "weights"]


class SleepyEngine(PausableEngine):
    """The pause tests' fake engine with the real one's memory-release rules."""

    def __init__(self) -> None:
        super().__init__()
        self.released: set[str] = set()

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> int:
        if self.has_running():
            raise ValueError("requests are running: pause with mode 'retract' or 'abort' first")
        self.released |= set(tags or ALL)
        return 1 << 20

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self.released -= set(tags or ALL)

    def step(self) -> list[StepOutput]:
        assert not self.released, "a step ran while memory was released"
        return super().step()

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
        if "weights" in self.released:
            raise ValueError("the weights are released: resume them first")
        super().update_weights_from_disk(path, weight_version)


def test_a_release_waits_for_no_request_then_holds_new_ones_and_lets_weights_change() -> None:
    engine = SleepyEngine()
    with wired_worker(engine) as w:
        w.send(add("running", tokens=30))
        _first_token(w, "running")
        w.send(p.WorkerReleaseMemory(token=1, tags=["kv_cache"]))
        refused = w.next(p.WorkerMemoryReply)
        assert (refused.token, refused.released) == (1, []) and "pause" in (refused.error or "")
        assert _ends(w, {"running"}) == {"running": "length"}
        w.send(p.WorkerReleaseMemory(token=2, tags=["kv_cache"]))
        assert w.next(p.WorkerMemoryReply) == p.WorkerMemoryReply(
            token=2, released=["kv_cache"], freed_bytes=1 << 20
        )
        w.send(
            add("held", tokens=2), p.WorkerUpdateWeights(token=3, path="/b", weight_version="v2")
        )
        reply = w.next(p.WorkerWeightsReply)
        assert (reply.error, reply.weight_version) == (None, "v2")  # applied while asleep
        _round_trips(w, 3)
        assert "held" not in engine._reqs
        w.send(p.WorkerResumeMemory(token=4, tags=["kv_cache"]))
        assert w.next(p.WorkerMemoryReply) == p.WorkerMemoryReply(token=4)
        assert _ends(w, {"held"}) == {"held": "length"}
    assert engine.added_under == {"running": "default", "held": "v2"}


def test_released_weights_refuse_an_update_and_a_retracted_request_waits_for_both() -> None:
    engine = SleepyEngine()
    with wired_worker(engine) as w:
        w.send(add("rollout", tokens=30))
        _first_token(w, "rollout")
        w.send(p.WorkerPause(token=1, mode="retract"), p.WorkerReleaseMemory(token=2, tags=ALL))
        assert w.next(p.WorkerMemoryReply) == p.WorkerMemoryReply(
            token=2, released=ALL, freed_bytes=1 << 20
        )
        w.send(p.WorkerContinue(token=3), p.WorkerUpdateWeights(token=4, path="/b"))
        assert w.next(p.WorkerWeightsReply).error == "the weights are released: resume them first"
        made = len(engine._reqs["rollout"].out)
        _round_trips(w, 3)
        assert len(engine._reqs["rollout"].out) == made  # continued, but asleep: no step
        w.send(p.WorkerResumeMemory(token=5, tags=["weights"]))
        assert w.next(p.WorkerMemoryReply).released == ["kv_cache"]
        w.send(p.WorkerUpdateWeights(token=6, path="/b", weight_version="v2"))
        assert w.next(p.WorkerWeightsReply).error is None
        w.send(p.WorkerResumeMemory(token=7, tags=ALL))
        assert w.next(p.WorkerMemoryReply).released == []
        assert _ends(w, {"rollout"}) == {"rollout": "length"}


def test_a_hello_again_says_what_is_paused_and_released() -> None:
    """Joining again (a restarted router asks every worker that speaks to), the worker's
    hello says its pause and released memory: the new router takes them as its own."""
    with wired_worker(SleepyEngine()) as w:
        w.send(p.WorkerPause(token=1, mode="retract"), p.WorkerReleaseMemory(token=2, tags=ALL))
        assert w.next(p.WorkerMemoryReply).released == ALL
        w.send(p.WorkerRejoin(join=0))
        hello = w.next(p.WorkerHello)
        assert (hello.paused, hello.memory_released, hello.join) == ("retract", ALL, 1)
        assert hello.hidden_size == 64  # the router bounds the hidden states in flight by it
        resume = p.WorkerResumeMemory(token=3, tags=ALL)
        w.send(resume, p.WorkerContinue(token=4), p.WorkerRejoin(join=1))
        hello = w.next(p.WorkerHello)
        assert (hello.paused, hello.memory_released) == (None, [])


def test_an_engine_that_cannot_release_memory_refuses() -> None:
    with wired_worker(FakeEngine()) as w:
        w.send(p.WorkerReleaseMemory(token=1, tags=["kv_cache"]))
        reply = w.next(p.WorkerMemoryReply)
        assert reply.error == "this worker's engine cannot release its memory"
        w.send(add("served", tokens=2))  # nothing held
        assert _ends(w, {"served"}) == {"served": "length"}
