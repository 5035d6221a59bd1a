"""The real worker loop in a thread around a fake engine, and a bare ROUTER socket playing
the router: for tests of what a worker does with the router's messages, in order."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import zmq

from radixserve.sampling_params import SamplingParams
from radixserve.serving.wire import protocol as p
from radixserve.serving.worker.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_engine import FakeEngine  # noqa: E402

__all__ = ["FakeEngine", "Wired", "add", "wired_worker"]


class Wired:
    """The router's end of one worker: send it messages, read what it sends."""

    def __init__(self, sock: zmq.Socket, identity: bytes) -> None:
        self.sock, self.identity = sock, identity

    def send(self, *msgs: Any) -> None:
        for msg in msgs:
            self.sock.send_multipart([self.identity, p.encode(msg)])

    def recv(self, timeout_s: float = 20.0) -> Any:
        assert self.sock.poll(int(timeout_s * 1000)), "the worker sent nothing"
        return p.decode_from_worker(self.sock.recv_multipart()[1])

    def next(self, kind: type) -> Any:
        """The next message of ``kind`` (others skipped)."""
        while True:
            msg = self.recv()
            if isinstance(msg, kind):
                return msg


@contextmanager
def wired_worker(engine: Any) -> Iterator[Wired]:
    """``engine`` served by a worker whose loop runs in a thread, until the block ends."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = Worker(engine, f"tcp://127.0.0.1:{port}", 0, context=ctx)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert router.poll(20_000), "no hello"
        identity, data = router.recv_multipart()
        assert isinstance(p.decode_from_worker(data), p.WorkerHello)
        yield Wired(router, identity)
    finally:
        worker.stop()
        thread.join(10)
        assert not thread.is_alive(), "the worker loop did not stop"
        router.close(linger=0)
        ctx.term()


def add(rid: str, lora: str | None = None, tokens: int = 3) -> p.WorkerAdd:
    """A request of ``tokens`` greedy tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return p.WorkerAdd(
        requests=[p.WorkerRequest(rid=rid, input_ids=[5, 6, 7], params=params, lora=lora)]
    )
