"""A worker reads a LoRA adapter's files off its step loop: requests keep stepping while a
load reads, and the loads and unloads are still applied, and answered, in the order the
router sent them; a request naming an adapter with an operation queued waits for it.

The real worker loop runs in a thread around the fake engine, whose adapter reads block
until the test lets them finish; a bare ROUTER socket plays the router."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from worker_harness import FakeEngine, Wired, add, wired_worker

from radixserve.serving.wire import protocol as p

pytestmark = pytest.mark.timeout(60)


class SlowLoraEngine(FakeEngine):
    """The fake engine with LoRA loading whose file reads wait until the test opens their
    gate (:meth:`gate`): a load whose files take as long as the test says."""

    def __init__(self) -> None:
        super().__init__(alphabet=list(range(60, 90)))
        self.gates: dict[str, threading.Event] = {}
        self.served: dict[str, str] = {}

    def gate(self, name: str) -> threading.Event:
        return self.gates.setdefault(name, threading.Event())

    def read_lora_adapter(self, name: str, path: str) -> tuple[str, str]:
        assert threading.current_thread() is not threading.main_thread()
        assert self.gate(name).wait(30), f"{name}'s read was never let through"
        if path == "missing":
            raise ValueError(f"no LoRA adapter at {path}")
        return name, f"{name}@{path}"

    def add_lora_adapter(self, adapter: tuple[str, str]) -> str:
        name, key = adapter
        self.served[name] = key
        return key

    def unload_lora_adapter(self, name: str) -> None:
        del self.served[name]

    @property
    def lora_adapters(self) -> dict[str, str]:
        return dict(self.served)

    def add_request(self, prompt_token_ids: list[int], params: Any, **kw: Any) -> str:
        lora = kw.pop("lora", None)
        if lora is not None and lora not in self.served:
            raise ValueError(f"unknown LoRA adapter {lora!r}")
        return super().add_request(prompt_token_ids, params, **kw)


@pytest.fixture
def wired() -> Iterator[tuple[Wired, SlowLoraEngine]]:
    engine = SlowLoraEngine()
    try:
        with wired_worker(engine) as w:
            yield w, engine
    finally:
        for gate in engine.gates.values():
            gate.set()


def test_requests_step_while_an_adapter_is_read(wired: Any) -> None:
    w, engine = wired
    w.send(p.WorkerLoadLora(token=1, name="sql", path="/a"), add("r1"))
    finished: set[str] = set()
    while "r1" not in finished:  # the whole request runs while the read waits
        msg = w.recv()
        assert not isinstance(msg, p.WorkerLoraReply), "the load did not wait for its read"
        if isinstance(msg, p.WorkerOutputs):
            finished |= {o.request_id for o in msg.outputs if o.finished}
    engine.gate("sql").set()
    reply = w.next(p.WorkerLoraReply)
    assert (reply.token, reply.error, reply.adapters) == (1, None, {"sql": "sql@/a"})


def test_operations_are_answered_in_the_order_they_were_sent(wired: Any) -> None:
    w, engine = wired
    w.send(
        p.WorkerLoadLora(token=1, name="slow", path="/s"),
        p.WorkerLoadLora(token=2, name="quick", path="missing"),
        p.WorkerUnloadLora(token=3, name="slow"),
    )
    engine.gate("quick").set()  # read first, but applied after "slow"'s load
    engine.gate("slow").set()
    replies = [w.next(p.WorkerLoraReply) for _ in range(3)]
    assert [r.token for r in replies] == [1, 2, 3]
    assert replies[0].adapters == {"slow": "slow@/s"}
    assert replies[1].error == "no LoRA adapter at missing"
    assert replies[2].error is None and replies[2].adapters == {}


def test_a_request_naming_a_queued_adapter_waits_for_its_load(wired: Any) -> None:
    w, engine = wired
    # As the router replays loads to a restarted worker, then sends the requests that waited.
    w.send(p.WorkerLoadLora(token=0, name="sql", path="/a"), add("r1", "sql"))
    threading.Timer(0.2, engine.gate("sql").set).start()  # lets the read end while blocked
    reply = w.next(p.WorkerLoraReply)
    assert reply.adapters == {"sql": "sql@/a"}
    out = w.next(p.WorkerOutputs)
    assert [o.request_id for o in out.outputs] == ["r1"]
    assert not out.outputs[0].error
