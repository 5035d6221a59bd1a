"""The asyncio router client waits for room when ZeroMQ has none, and loses nothing.

Its socket is a plain pyzmq one read from the event loop's descriptor watch; a send that
finds the pipe full (``zmq.Again``) must wait until the router has read, then go. A fake
router (a ROUTER socket on an inproc endpoint, read one message at a time from a thread once
the sends are stuck) and high-water marks of one message make the pipe fill after two sends.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import zmq

from radixserve.serving.client.async_client import AsyncClient
from radixserve.serving.wire import protocol as p


class _TinyPipes(zmq.Context):
    """A context whose sockets queue at most one outgoing message."""

    def socket(self, socket_type: int, **kwargs: Any) -> zmq.Socket:  # type: ignore[override]
        sock = super().socket(socket_type, **kwargs)
        sock.setsockopt(zmq.SNDHWM, 1)
        sock.setsockopt(zmq.RCVHWM, 1)
        return sock


async def _send_more_than_fits() -> list[str]:
    ctx = _TinyPipes()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, 10_000)
    router.bind("inproc://tiny-router")
    client = AsyncClient("inproc://tiny-router", timeout=30.0, context=ctx)
    got: list[str] = []

    def read(count: int) -> None:  # the router, one message at a time, in its own thread
        for _ in range(count):
            _, frame = router.recv_multipart()
            msg = p.decode_client(frame)
            assert isinstance(msg, p.Abort)
            got.append(msg.request_id)

    try:
        sends = [asyncio.ensure_future(client.abort(f"r{i}")) for i in range(8)]
        await asyncio.sleep(0)  # one loop turn: every send has tried once, nobody reads yet
        assert not all(s.done() for s in sends), "nothing waited: the pipe was not full"
        reader = threading.Thread(target=read, args=(len(sends),))
        reader.start()
        await asyncio.wait_for(asyncio.gather(*sends), 10)
        reader.join(10)
        assert not reader.is_alive()
        return got
    finally:
        await client.close()
        router.close()
        ctx.term()


def test_sends_wait_for_room_and_all_arrive() -> None:
    got = asyncio.run(_send_more_than_fits())
    assert sorted(got) == sorted(f"r{i}" for i in range(8))
