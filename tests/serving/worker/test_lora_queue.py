"""A worker reads a LoRA adapter's files off its step loop: requests keep stepping while a
load reads, and the loads and unloads are still applied, and answered, in the order the
router sent them; a request naming an adapter with an operation queued waits for it.

The real worker loop runs in a thread around the fake engine, whose adapter reads block
until the test lets them finish; a bare ROUTER socket plays the router."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from radixserve.sampling_params import SamplingParams
from radixserve.serving.wire import protocol as p
from radixserve.serving.worker.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_engine import FakeEngine  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class SlowLoraEngine(FakeEngine):
    """The fake engine with LoRA loading whose file reads wait for :attr:`reads` to be let
    through (``release(name)``): a load whose files take as long as the test says."""

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
def wired() -> Iterator[tuple[zmq.Socket, bytes, SlowLoraEngine]]:
    """(router socket, the worker's identity, its engine), the worker looping in a thread."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    engine = SlowLoraEngine()
    worker = Worker(engine, f"tcp://127.0.0.1:{port}", 0, context=ctx)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        identity, hello = _recv(router)
        assert isinstance(hello, p.WorkerHello)
        yield router, identity, engine
    finally:
        for gate in engine.gates.values():
            gate.set()
        worker.stop()
        thread.join(10)
        assert not thread.is_alive(), "the worker loop did not stop"
        router.close(linger=0)
        ctx.term()


def _recv(sock: zmq.Socket, timeout_s: float = 20.0) -> tuple[bytes, Any]:
    assert sock.poll(int(timeout_s * 1000)), "the worker sent nothing"
    identity, data = sock.recv_multipart()
    return identity, p.decode_from_worker(data)


def _next(sock: zmq.Socket, kind: type) -> Any:
    """The next message of ``kind`` (heartbeats, loads and the like skipped)."""
    while True:
        msg = _recv(sock)[1]
        if isinstance(msg, kind):
            return msg


def _add(rid: str, lora: str | None = None) -> p.WorkerAdd:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    return p.WorkerAdd(
        requests=[p.WorkerRequest(rid=rid, input_ids=[5, 6, 7], params=params, lora=lora)]
    )


def _send(sock: zmq.Socket, identity: bytes, *msgs: Any) -> None:
    for msg in msgs:
        sock.send_multipart([identity, p.encode(msg)])


def test_requests_step_while_an_adapter_is_read(wired: Any) -> None:
    router, identity, engine = wired
    _send(router, identity, p.WorkerLoadLora(token=1, name="sql", path="/a"), _add("r1"))
    finished: set[str] = set()
    while "r1" not in finished:  # the whole request runs while the read waits
        msg = _recv(router)[1]
        assert not isinstance(msg, p.WorkerLoraReply), "the load did not wait for its read"
        if isinstance(msg, p.WorkerOutputs):
            finished |= {o.request_id for o in msg.outputs if o.finished}
    engine.gate("sql").set()
    reply = _next(router, p.WorkerLoraReply)
    assert (reply.token, reply.error, reply.adapters) == (1, None, {"sql": "sql@/a"})


def test_operations_are_answered_in_the_order_they_were_sent(wired: Any) -> None:
    router, identity, engine = wired
    _send(
        router,
        identity,
        p.WorkerLoadLora(token=1, name="slow", path="/s"),
        p.WorkerLoadLora(token=2, name="quick", path="missing"),
        p.WorkerUnloadLora(token=3, name="slow"),
    )
    engine.gate("quick").set()  # read first, but applied after "slow"'s load
    engine.gate("slow").set()
    replies = [_next(router, p.WorkerLoraReply) for _ in range(3)]
    assert [r.token for r in replies] == [1, 2, 3]
    assert replies[0].adapters == {"slow": "slow@/s"}
    assert replies[1].error == "no LoRA adapter at missing"
    assert replies[2].error is None and replies[2].adapters == {}


def test_a_request_naming_a_queued_adapter_waits_for_its_load(wired: Any) -> None:
    router, identity, engine = wired
    # As the router replays loads to a restarted worker, then sends the requests that waited.
    _send(router, identity, p.WorkerLoadLora(token=0, name="sql", path="/a"), _add("r1", "sql"))
    threading.Timer(0.2, engine.gate("sql").set).start()  # lets the read end while blocked
    reply = _next(router, p.WorkerLoraReply)
    assert reply.adapters == {"sql": "sql@/a"}
    out = _next(router, p.WorkerOutputs)
    assert [o.request_id for o in out.outputs] == ["r1"]
    assert not out.outputs[0].error
