"""The asyncio client of the radixserve router: any number of concurrent requests on one socket.

Torch-free (pyzmq + msgspec only). The event loop watches the DEALER socket's file
descriptor; when it fires, every queued message is taken off and handed to the queue of
its request (by the ``request_id`` the router echoes).

The socket is a plain (blocking-API) pyzmq socket read with ``NOBLOCK``, not a
``zmq.asyncio`` one: the HTTP gateway streams every token of every request through here,
and pyzmq's asyncio layer costs a future, several callbacks and a dozen flag-enum
operations per message, which measured as a sixth of the gateway's CPU per token.
ZeroMQ's descriptor is edge-triggered ("look at ``zmq.EVENTS``"), and any operation on the
socket, a send included, may consume the edge; so the reader drains until ``EVENTS`` says
nothing is left, and runs again after every send.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any, Unpack

import zmq

from radixserve.serving.client.common import (
    ChatRendering,
    Event,
    GenerateOptions,
    RequestIds,
    ServerError,
    generate_request,
)
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire import zmq_events
from radixserve.serving.wire.base import DEFAULT_ENDPOINT
from radixserve.serving.wire.security import PeerKeys


class AsyncClient:
    """asyncio client: any number of concurrent requests on one socket (``curve``: as
    :class:`~radixserve.serving.client.Client`'s). ``context``: the ZeroMQ context to use
    (default: the process's shared one); an ``inproc://`` endpoint needs its router's."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout: float | None = 60.0,
        curve: PeerKeys | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sock: zmq.Socket = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sock)
        self._sock.connect(endpoint)
        self._ids = RequestIds()
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._generating: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop watching the socket
        self._writable: list[asyncio.Future[None]] = []  # senders waiting for room (rare)
        self._pending: set[asyncio.Task[None]] = set()  # sends that could not wait (aborts)
        self._last_rx = 0.0  # when the router last sent anything

    def _watch(self) -> asyncio.AbstractEventLoop:
        """Have the running loop call :meth:`_on_events` when the socket's descriptor fires."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.FD)
            self._loop = loop
            loop.add_reader(self._sock.FD, self._on_events)
        return loop

    def _on_events(self) -> None:
        """Take every queued message off the socket; wake senders once there is room."""
        sock = self._sock
        while not sock.closed:
            ready = zmq_events.events(sock)
            if ready & zmq_events.POLLOUT and self._writable:
                for fut in self._writable:
                    if not fut.done():
                        fut.set_result(None)
                self._writable.clear()
            if not ready & zmq_events.POLLIN:
                return
            self._dispatch(p.decode_server(sock.recv(zmq_events.NOBLOCK)))

    def _dispatch(self, msg: Any) -> None:
        self._last_rx = time.monotonic()
        if isinstance(msg, p.KeepAlive):
            return
        rid = getattr(msg, "request_id", None)
        targets = [self._queues[rid]] if rid in self._queues else []
        if rid is None:  # cannot be tied to a request: fail every waiter
            targets = list(self._queues.values())
        for q in targets:
            q.put_nowait(msg)

    async def _send(self, msg: Any) -> None:
        """Queue ``msg`` for the router, waiting while ZeroMQ has no room for it."""
        loop = self._watch()
        data = p.encode(msg)
        while True:
            try:
                self._sock.send(data, zmq_events.NOBLOCK)
                break
            except zmq.Again:
                fut = loop.create_future()
                self._writable.append(fut)
                loop.call_soon(self._on_events)  # room may have come before we watched
                await fut
        # The send may have consumed the descriptor's edge for messages that arrived meanwhile.
        loop.call_soon(self._on_events)

    def _send_nowait(self, msg: Any) -> None:
        """Send ``msg`` now, from code that cannot wait (a closing generator); with no room
        for it, a task sends it once there is."""
        loop = self._loop
        try:
            self._sock.send(p.encode(msg), zmq_events.NOBLOCK)
        except zmq.Again:
            if loop is not None and not loop.is_closed():
                self._pending.add(task := loop.create_task(self._send(msg)))
                task.add_done_callback(self._pending.discard)
            return
        if loop is not None and not loop.is_closed():
            loop.call_soon(self._on_events)

    def _open(self, rid: str) -> asyncio.Queue[Any]:
        if rid in self._queues:  # a second waiter would orphan the first
            raise ValueError(f"request id {rid!r} is already in flight on this client")
        self._watch()
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
            await self._send(msg)
            return await self._next(msg.request_id, q, timeout)
        finally:
            self._queues.pop(msg.request_id, None)

    async def stream(
        self,
        text: str | None = None,
        *,
        stream: bool = True,
        request_id: str | None = None,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncGenerator[Event, None]:
        """Yield chunks then the final; cancelling or closing the iterator early aborts."""
        rid = request_id or self._ids.next()
        q = self._open(rid)
        self._generating.add(rid)
        done = False
        try:
            req = generate_request(rid, text, stream, options)
            await self._send(req)
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
                self._send_nowait(p.Abort(request_id=rid))

    async def generate(self, text: str | None = None, **kwargs: Any) -> p.GenerateFinal:
        """Generate and wait for the final message."""
        kwargs["stream"] = False
        async for ev in self.stream(text, **kwargs):
            if isinstance(ev, p.GenerateFinal):
                return ev
        raise AssertionError("unreachable")

    def new_request_id(self) -> str:
        """An id no other request on this client has (for :meth:`stream`'s ``request_id``,
        where the caller must know it before the request starts: to :meth:`abort` it)."""
        return self._ids.next()

    async def abort(self, request_id: str) -> None:
        await self._send(p.Abort(request_id=request_id))

    async def health(self, timeout: float | None = None) -> p.HealthReply:
        return await self._call(p.Health(request_id=self._ids.next()), timeout)

    async def stats(self, timeout: float | None = None) -> p.StatsReply:
        return await self._call(p.StatsRequest(request_id=self._ids.next()), timeout)

    async def model_info(self, timeout: float | None = None) -> p.ModelInfo:
        return await self._call(p.ModelInfoRequest(request_id=self._ids.next()), timeout)

    async def flush_cache(self, timeout: float | None = None) -> bool:
        return (await self._call(p.FlushCache(request_id=self._ids.next()), timeout)).ok

    async def load_lora_adapter(
        self, name: str, path: str, timeout: float | None = None
    ) -> p.LoraAdapterReply:
        """Have every worker serve the PEFT adapter at ``path`` (a directory on the workers'
        hosts) as ``name``; the reply says whether they all do (an authenticated client
        only)."""
        msg = p.LoadLoraAdapter(request_id=self._ids.next(), name=name, path=path)
        return await self._call(msg, timeout)

    async def unload_lora_adapter(
        self, name: str, timeout: float | None = None
    ) -> p.LoraAdapterReply:
        """Have every worker stop serving adapter ``name`` (its running requests finish)."""
        msg = p.UnloadLoraAdapter(request_id=self._ids.next(), name=name)
        return await self._call(msg, timeout)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, timeout: float | None = None
    ) -> p.UpdateWeightsReply:
        """Have every worker serve the weights of the checkpoint at ``model_path`` (a
        directory on the workers' hosts, of the served architecture), named
        ``weight_version``; each finishes its running requests first and holds new ones
        meanwhile. The reply says whether they all do (an authenticated client only)."""
        msg = p.UpdateWeights(
            request_id=self._ids.next(), model_path=model_path, weight_version=weight_version
        )
        return await self._call(msg, timeout)

    async def pause_generation(
        self,
        mode: p.PauseMode = "abort",
        clear_cache: bool = False,
        timeout: float | None = None,
    ) -> p.PauseReply:
        """Have every worker stop generating until :meth:`continue_generation` (SGLang's
        ``pause_generation``): requests sent meanwhile wait; ``mode`` says what becomes of
        the running ones ("abort", "retract", "in_place" or "wait"); ``clear_cache`` then
        drops the cached prefixes (with "abort" and "wait"). An authenticated client only."""
        msg = p.PauseGeneration(request_id=self._ids.next(), mode=mode, clear_cache=clear_cache)
        return await self._call(msg, timeout)

    async def continue_generation(self, timeout: float | None = None) -> p.PauseReply:
        """Have every worker generate again after :meth:`pause_generation`."""
        msg = p.ContinueGeneration(request_id=self._ids.next())
        return await self._call(msg, timeout)

    async def release_memory_occupation(
        self, tags: list[p.MemoryTag] | None = None, timeout: float | None = None
    ) -> p.MemoryReply:
        """Have every worker give the memory of ``tags`` ("kv_cache", "weights"; None: both)
        back to the OS (SGLang's ``release_memory_occupation``): requests sent meanwhile wait
        for :meth:`resume_memory_occupation`; refused while a request runs (pause with
        "retract" or "abort" first). Released weights are undefined until
        :meth:`update_weights_from_disk` after the resume. An authenticated client only."""
        msg = p.ReleaseMemory(request_id=self._ids.next(), tags=tags)
        return await self._call(msg, timeout)

    async def resume_memory_occupation(
        self, tags: list[p.MemoryTag] | None = None, timeout: float | None = None
    ) -> p.MemoryReply:
        """Have every worker take the memory of ``tags`` again (None: both)."""
        msg = p.ResumeMemory(request_id=self._ids.next(), tags=tags)
        return await self._call(msg, timeout)

    async def close_session(
        self,
        session_id: str,
        *,
        namespace: str | None = None,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> bool:
        """End a session: its lease is released on every worker. Returns whether one held it."""
        msg = p.CloseSession(
            request_id=self._ids.next(),
            session_id=session_id,
            namespace=namespace,
            cache_salt=cache_salt,
        )
        return (await self._call(msg, timeout)).released

    async def tokenize(
        self, texts: list[str], timeout: float | None = None, *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of each text, as the router encodes a ``text`` prompt (without the
        tokenizer's special tokens when ``add_special_tokens`` is False)."""
        return (
            await self._call(
                p.TokenizeRequest(
                    request_id=self._ids.next(),
                    texts=list(texts),
                    add_special_tokens=add_special_tokens,
                ),
                timeout,
            )
        ).input_ids

    async def detokenize(
        self,
        token_ids: list[int],
        timeout: float | None = None,
        *,
        skip_special_tokens: bool = False,
    ) -> str:
        """The text of ``token_ids``, decoded by the router's tokenizer."""
        msg = p.DetokenizeRequest(
            request_id=self._ids.next(),
            token_ids=list(token_ids),
            skip_special_tokens=skip_special_tokens,
        )
        return (await self._call(msg, timeout)).text

    async def tokenize_chat(
        self,
        messages: list[p.ChatMessage],
        timeout: float | None = None,
        **rendering: Unpack[ChatRendering],
    ) -> list[int]:
        """Token ids of the chat prompt ``messages`` render to, as the router encodes a
        ``messages`` prompt."""
        msg = p.TokenizeRequest(request_id=self._ids.next(), messages=list(messages), **rendering)
        (ids,) = (await self._call(msg, timeout)).input_ids
        return ids

    async def close(self) -> None:
        """Abort unfinished requests, stop the reader, close the socket."""
        if self._sock.closed:
            return
        for rid in list(self._generating):
            await self._send(p.Abort(request_id=rid))
        self._generating.clear()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.FD)
        self._loop = None
        for fut in self._writable:
            fut.cancel()
        self._writable.clear()
        self._sock.close(linger=200)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
