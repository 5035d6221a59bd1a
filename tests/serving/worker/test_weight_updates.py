"""A worker applies a weight update between requests: the requests running when it comes
finish first, those sent after it wait and then run with the new weights, one aborted
while it waits ends at once, and a failed update is answered and changes nothing.

The real worker loop runs in a thread around the fake engine, slowed to 20 ms a step so
that a request is still running when the messages after it arrive."""

from __future__ import annotations

from typing import Any

import pytest
from worker_harness import FakeEngine, Wired, add, wired_worker

from radixserve.serving.wire import protocol as p

pytestmark = pytest.mark.timeout(60)


class UpdatableEngine(FakeEngine):
    """The fake engine with weights to update: each request records the version it was
    added under; an update while requests run, or from ``missing``, fails as the engine's."""

    def __init__(self) -> None:
        super().__init__(alphabet=list(range(60, 90)), step_delay=0.02)
        self.weight_version, self.model_path = "default", "/a"
        self.added_under: dict[str, str] = {}

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
        assert not self.has_unfinished(), "updated while requests run"
        if path == "missing":
            raise ValueError(f"no checkpoint at {path}")
        self.model_path = path
        self.weight_version = weight_version or self.weight_version

    def add_request(self, prompt_token_ids: list[int], params: Any, **kw: Any) -> str:
        rid = super().add_request(prompt_token_ids, params, **kw)
        self.added_under[rid] = self.weight_version
        return rid


def _events(w: Wired, until: set[str]) -> list[tuple[str, Any]]:
    """What the worker sends until ``until`` are all seen: ("done", rid), ("reply", token)."""
    seen: list[tuple[str, Any]] = []
    while not until <= {x for _, x in seen}:
        msg = w.recv()
        if isinstance(msg, p.WorkerOutputs):
            seen += [("done", o.request_id) for o in msg.outputs if o.finished]
        elif isinstance(msg, p.WorkerWeightsReply):
            assert msg.error is None, msg.error
            seen.append(("reply", f"update-{msg.token}"))
    return seen


def test_running_requests_finish_first_and_later_ones_wait_for_the_new_weights() -> None:
    engine = UpdatableEngine()
    with wired_worker(engine) as w:
        w.send(
            add("before", tokens=10),
            p.WorkerUpdateWeights(token=1, path="/b", weight_version="v2"),
            add("after", tokens=2),
        )
        order = _events(w, {"before", "after", "update-1"})
    assert [x for _, x in order] == ["before", "update-1", "after"]
    assert engine.added_under == {"before": "default", "after": "v2"}
    assert engine.model_path == "/b"


def test_a_held_request_aborted_ends_at_once_and_a_failed_update_changes_nothing() -> None:
    engine = UpdatableEngine()
    with wired_worker(engine) as w:
        w.send(
            add("running", tokens=10),
            p.WorkerUpdateWeights(token=1, path="missing"),
            add("held", tokens=2),
            p.WorkerAbort(rids=["held"]),
        )
        ends: dict[str, Any] = {}
        while "held" not in ends:  # before the running request ends: it never started
            out = w.next(p.WorkerOutputs)
            ends |= {o.request_id: o.finish_reason for o in out.outputs if o.finished}
        assert ends == {"held": "abort"}
        reply = w.next(p.WorkerWeightsReply)
        assert reply.error == "no checkpoint at missing"
        assert (reply.model_path, reply.weight_version) == ("/a", "default")
    assert "held" not in engine.added_under
