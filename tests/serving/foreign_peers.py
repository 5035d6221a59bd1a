"""Playing a foreign local process against a real server: connect to its worker port, say
hello as a worker would, and see what comes back (test_security.py, test_local_join.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from radixserve.serving.wire import protocol as p


def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``pred`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def worker_hello(tokenizer: Any) -> bytes:
    """The hello a worker of the tiny tokenizer's model sends when it joins."""
    return p.encode(
        p.WorkerHello(
            worker_id=-1,
            pid=4242,
            model="fake",
            context_length=256,
            vocab_size=len(tokenizer),
            eos_token_ids=[2],
            page_size=4,
        )
    )


def say_hello(srv: Any, tokenizer: Any, sockets: list[zmq.Socket]) -> None:
    """Connect each DEALER to ``srv``'s worker port and say hello as a worker would."""
    for s in sockets:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(srv.router.worker_endpoint)
        s.send(worker_hello(tokenizer))


def received(sockets: list[zmq.Socket], seconds: float) -> list[bytes]:
    """Every frame the sockets get within ``seconds`` (the router pings workers every 0.1 s)."""
    got: list[bytes] = []
    poller = zmq.Poller()
    for s in sockets:
        poller.register(s, zmq.POLLIN)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        for s, _ in poller.poll(int(left * 1000)):
            got.append(s.recv())
    return got
