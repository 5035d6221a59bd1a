"""The asyncio router client gives up a request when its consumer is cancelled, even when a
message for it arrives in the same event-loop turn as the cancellation.

That is what the HTTP gateway does when a non-streamed request's client disconnects: it
cancels the task that collects the request's chunks. On Python 3.11, ``asyncio.wait_for``
returned the message and dropped such a cancellation, and the request ran on to its
``max_tokens`` for nobody (the random ``test_disconnect_mid_stream_aborts_and_frees_kv``
failure). A fake router (a ROUTER socket on loopback) stands in for the real one.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from radixserve.serving.client.async_client import AsyncClient
from radixserve.serving.wire import protocol as p


async def _cancel_as_a_chunk_arrives() -> tuple[bool, p.Abort]:
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = AsyncClient(f"tcp://127.0.0.1:{port}", timeout=30.0)
    try:

        async def consume() -> None:
            async for _ in client.stream("hello", request_id="r1"):
                pass

        task = asyncio.create_task(consume())
        identity, frame = await asyncio.wait_for(router.recv_multipart(), 10)
        assert isinstance(p.decode_client(frame), p.GenerateRequest)
        # The consumer sent its request before the router could read it, so it is now
        # waiting for its next message. Deliver one and cancel in the same loop turn.
        client._queues["r1"].put_nowait(
            p.GenerateChunk(request_id="r1", index=0, token_ids=[5], text="x")
        )
        task.cancel()
        try:
            await asyncio.wait_for(task, 10)
        except asyncio.CancelledError:
            pass
        cancelled = task.cancelled()
        _, frame = await asyncio.wait_for(router.recv_multipart(), 10)
        return cancelled, p.decode_client(frame)
    finally:
        await client.close()
        router.close()


def test_cancel_racing_a_message_still_cancels_and_aborts() -> None:
    cancelled, abort = asyncio.run(_cancel_as_a_chunk_arrives())
    assert cancelled, "the cancellation was swallowed: the request would run to its end"
    assert isinstance(abort, p.Abort) and abort.request_id == "r1"
