"""A worker judges its router's liveness by the connection, not by silence: a router that
is busy (silent, but its zmq I/O thread still answers heartbeats) is waited for; a router
that is gone makes a local worker exit."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import zmq

from radixserve.serving.router.worker_pool import spawn_worker, worker_command
from radixserve.serving.wire import protocol as p

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def _recv(sock: zmq.Socket, timeout_s: float = 30.0) -> tuple[bytes, Any]:
    """(sender identity, message) of the next message from the worker."""
    assert sock.poll(int(timeout_s * 1000)), "the worker sent nothing"
    identity, data = sock.recv_multipart()
    return identity, p.decode_from_worker(data)


def _router_and_worker(
    fake_worker_cmd: list[str], alphabet: list[int], **worker: Any
) -> tuple[zmq.Context, zmq.Socket, Any]:
    """A bare ROUTER socket playing the router, and a fake-engine worker connected to it."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    cmd = worker_command(
        f"tcp://127.0.0.1:{port}",
        0,
        "unused",
        {"alphabet": alphabet},
        parent_pid=os.getpid(),
        program=fake_worker_cmd,
        **worker,
    )
    return ctx, router, spawn_worker(cmd)


def test_busy_router_is_waited_for_a_gone_one_is_left(
    fake_worker_cmd: list[str], alphabet: list[int]
) -> None:
    ctx, router, proc = _router_and_worker(fake_worker_cmd, alphabet, heartbeat_timeout_s=1.0)
    try:
        identity, hello = _recv(router)
        assert isinstance(hello, p.WorkerHello)
        # Busy: the router's loop sends nothing for 4x the worker's timeout (its I/O thread
        # still answers the ZMTP heartbeats). The worker stays.
        time.sleep(4.0)  # the silence under test, not a synchronization
        assert proc.poll() is None, "the worker left a router that was only busy"
        # Still serving: a ping after the silence gets its heartbeat.
        router.send_multipart([identity, p.encode(p.WorkerPing())])
        assert isinstance(_recv(router)[1], p.WorkerHeartbeat)
        # Gone: the router's socket closes. The connection is lost; after the timeout the
        # local worker says goodbye to no one and exits.
        router.close(linger=0)
        t0 = time.monotonic()
        assert proc.wait(20) == 0
        assert time.monotonic() - t0 < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        ctx.term()


def test_an_idle_worker_speaks_to_a_silent_router_and_rejoins_when_asked(
    fake_worker_cmd: list[str], alphabet: list[int]
) -> None:
    """A router that gave this worker up (declared it dead over a pause both slept through)
    pings it no more, and an idle worker has nothing else to send: after SPEAK_UP_S of
    silence, connected, the worker sends a heartbeat unasked; told to join again
    (WorkerRejoin, as the router answers a dead worker that speaks), it says hello, once:
    an ask naming a join it has left behind is ignored."""
    from radixserve.serving.worker.worker import SPEAK_UP_S

    ctx, router, proc = _router_and_worker(fake_worker_cmd, alphabet)
    try:
        identity, hello = _recv(router)
        assert isinstance(hello, p.WorkerHello)
        t0 = time.monotonic()
        unasked = _recv(router, timeout_s=3 * SPEAK_UP_S)[1]  # no ping was sent
        assert isinstance(unasked, p.WorkerHeartbeat)
        assert time.monotonic() - t0 > SPEAK_UP_S / 2
        assert hello.join == 0
        router.send_multipart([identity, p.encode(p.WorkerRejoin(join=0))])
        again = _recv(router)[1]
        assert isinstance(again, p.WorkerHello) and again.join == 1
        # The same ask once more, now stale (join 0 was given up, join 1 is live), as when it
        # crosses a hello the worker said on its own: ignored. The ping after it is answered
        # first, in order, with no second hello before it.
        router.send_multipart([identity, p.encode(p.WorkerRejoin(join=0))])
        router.send_multipart([identity, p.encode(p.WorkerPing())])
        assert isinstance(_recv(router)[1], p.WorkerHeartbeat)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        router.close(linger=0)
        ctx.term()


def test_every_router_message_has_a_handler() -> None:
    """The worker answers each kind of message the router sends (the protocol's union): a
    kind added to it without a handler would be dropped in silence."""
    import typing

    from fake_engine import FakeEngine

    from radixserve.serving.worker.worker import Worker

    ctx = zmq.Context()
    worker = Worker(FakeEngine(), "ipc:///tmp/radixserve-no-router.sock", context=ctx)  # type: ignore[arg-type]
    try:
        assert set(worker._handlers) == set(typing.get_args(p.RouterToWorker))
    finally:
        worker.sock.close(linger=0)
        worker._monitor.close(linger=0)
        ctx.term()
