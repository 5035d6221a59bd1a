"""The asyncio client of the radixserve router: any number of concurrent requests on one socket.

Torch-free (pyzmq + msgspec only). One reader task takes every message off the DEALER
socket and hands it to the queue of its request (by the ``request_id`` the router echoes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import zmq
import zmq.asyncio

from radixserve.sampling_params import SamplingParams
from radixserve.serving import protocol as p
from radixserve.serving.client_common import (
    DEFAULT_ENDPOINT,
    Event,
    RequestIds,
    ServerError,
    generate_request,
)
from radixserve.serving.security import PeerKeys


class AsyncClient:
    """asyncio client: any number of concurrent requests on one socket (``curve``: as
    :class:`~radixserve.serving.client.Client`'s)."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout: float | None = 60.0,
        curve: PeerKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sock)
        self._sock.connect(endpoint)
        self._ids = RequestIds()
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._generating: set[str] = set()
        self._reader: asyncio.Task[None] | None = None
        self._last_rx = 0.0  # when the router last sent anything

    async def _read(self) -> None:
        while True:
            msg = p.decode_server(await self._sock.recv())
            self._last_rx = time.monotonic()
            if isinstance(msg, p.KeepAlive):
                continue
            rid = getattr(msg, "request_id", None)
            targets = [self._queues[rid]] if rid in self._queues else []
            if rid is None:  # cannot be tied to a request: fail every waiter
                targets = list(self._queues.values())
            for q in targets:
                q.put_nowait(msg)

    def _open(self, rid: str) -> asyncio.Queue[Any]:
        if rid in self._queues:  # a second waiter would orphan the first
            raise ValueError(f"request id {rid!r} is already in flight on this client")
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[rid] = q
        return q

    async def _next(self, rid: str, q: asyncio.Queue[Any], timeout: float | None) -> Any:
        """The next message for ``rid``; times out after ``timeout`` s without *any* message
        from the router (its keep-alives count: a long non-streamed request is not a dead router)."""
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        while True:
            wait = (
                None
                if limit is None
                else max(0.0, max(start, self._last_rx) + limit - time.monotonic())
            )
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
                # that lands in the same loop turn as a message (it returns the message), and a
                # gateway whose HTTP client left would then run the request to its end.
                async with asyncio.timeout(wait):
                    msg = await q.get()
                break
            except TimeoutError:
                if limit is not None and time.monotonic() - max(start, self._last_rx) >= limit:
                    raise TimeoutError(
                        f"no reply from {self.endpoint} for request {rid} within {limit} s"
                    ) from None
        if isinstance(msg, p.Error):
            raise ServerError(msg)
        return msg

    async def _call(self, msg: Any, timeout: float | None) -> Any:
        q = self._open(msg.request_id)
        try:
            await self._sock.send(p.encode(msg))
            return await self._next(msg.request_id, q, timeout)
        finally:
            self._queues.pop(msg.request_id, None)

    async def stream(
        self,
        text: str | None = None,
        *,
        input_ids: list[int] | None = None,
        messages: list[p.ChatMessage] | list[dict[str, str]] | None = None,
        params: SamplingParams | None = None,
        session_id: str | None = None,
        namespace: str | None = None,
        add_generation_prompt: bool = True,
        stream: bool = True,
        request_id: str | None = None,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[Event, None]:
        """Yield chunks then the final; cancelling or closing the iterator early aborts."""
        rid = request_id or self._ids.next()
        q = self._open(rid)
        self._generating.add(rid)
        done = False
        try:
            req = generate_request(
                rid,
                text,
                input_ids,
                messages,
                params,
                stream,
                session_id,
                namespace,
                add_generation_prompt,
                cache_salt,
            )
            await self._sock.send(p.encode(req))
            while True:
                msg = await self._next(rid, q, timeout)
                if isinstance(msg, p.GenerateFinal):
                    done = True
                yield msg
                if done:
                    return
        except ServerError:
            done = True
            raise
        finally:
            self._queues.pop(rid, None)
            self._generating.discard(rid)
            if not done and not self._sock.closed:
                self._sock.send(p.encode(p.Abort(request_id=rid)), zmq.NOBLOCK)

    async def generate(self, text: str | None = None, **kwargs: Any) -> p.GenerateFinal:
        """Generate and wait for the final message."""
        kwargs["stream"] = False
        async for ev in self.stream(text, **kwargs):
            if isinstance(ev, p.GenerateFinal):
                return ev
        raise AssertionError("unreachable")

    async def abort(self, request_id: str) -> None:
        await self._sock.send(p.encode(p.Abort(request_id=request_id)))

    async def health(self, timeout: float | None = None) -> p.HealthReply:
        return await self._call(p.Health(request_id=self._ids.next()), timeout)

    async def stats(self, timeout: float | None = None) -> p.StatsReply:
        return await self._call(p.StatsRequest(request_id=self._ids.next()), timeout)

    async def model_info(self, timeout: float | None = None) -> p.ModelInfo:
        return await self._call(p.ModelInfoRequest(request_id=self._ids.next()), timeout)

    async def flush_cache(self, timeout: float | None = None) -> bool:
        return (await self._call(p.FlushCache(request_id=self._ids.next()), timeout)).ok

    async def tokenize(self, texts: list[str], timeout: float | None = None) -> list[list[int]]:
        """Token ids of each text, as the router encodes a ``text`` prompt."""
        return (
            await self._call(
                p.TokenizeRequest(request_id=self._ids.next(), texts=list(texts)), timeout
            )
        ).input_ids

    async def close(self) -> None:
        """Abort unfinished requests, stop the reader, close the socket."""
        if self._sock.closed:
            return
        for rid in list(self._generating):
            await self._sock.send(p.encode(p.Abort(request_id=rid)))
        self._generating.clear()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, zmq.ZMQError):
                pass
        self._sock.close(linger=200)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
