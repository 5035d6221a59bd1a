"""The synchronous client of the radixserve router: :class:`Client`.

Torch-free (pyzmq + msgspec only). Each client owns one DEALER socket; every request gets
a client-side ``request_id`` that the router echoes, so many requests multiplex on one
socket. A ZeroMQ socket is not thread-safe: use one :class:`Client` per thread, or one
:class:`AsyncClient` for any number of concurrent requests in an event loop.

:class:`~radixserve.serving.client.async_client.AsyncClient` is the asyncio one; what both
share is in :mod:`radixserve.serving.client.common`; both are importable from
:mod:`radixserve.serving.client`.

Run ``radixserve client --endpoint tcp://127.0.0.1:5555 "Hello"`` for a
streaming demo.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Unpack

import zmq

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client.common import (
    ChatRendering,
    Event,
    GenerateOptions,
    RequestIds,
    ServerError,
    generate_request,
)
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire.base import DEFAULT_ENDPOINT
from radixserve.serving.wire.security import PeerKeys


class Client:
    """Synchronous client. ``timeout``: seconds without any reply before giving up
    (the router sends keep-alives while requests run, so this detects a dead router).
    ``curve``: client keys for a router that takes only CURVE-authenticated clients
    (:func:`~radixserve.serving.wire.security.load_peer_keys`)."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout: float | None = 60.0,
        context: zmq.Context | None = None,
        curve: PeerKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self._sock)
        self._sock.connect(endpoint)
        self._ids = RequestIds()
        self._queues: dict[str, deque[Any]] = {}
        self._unclaimed: deque[p.Error] = deque()  # errors the router could not tie to a request
        self._generating: set[str] = set()

    # ------------------------------------------------------------------ plumbing
    def _send(self, msg: Any) -> None:
        self._sock.send(p.encode(msg))

    def _pump(self, wait_s: float | None) -> bool:
        """Receive what is there (waiting at most ``wait_s``) and queue it by request id;
        True if anything at all arrived (keep-alives too: the router is alive)."""
        if not self._sock.poll(None if wait_s is None else max(1, int(wait_s * 1000))):
            return False
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            msg = p.decode_server(frame)
            rid = getattr(msg, "request_id", None)
            if isinstance(msg, p.KeepAlive):
                continue
            if isinstance(msg, p.Error) and msg.request_id is None:
                self._unclaimed.append(msg)
            elif rid in self._queues:
                self._queues[rid].append(msg)
            # Anything else answers a request we already gave up on: drop it.

    def _next(self, rid: str, timeout: float | None) -> Any:
        queue = self._queues[rid]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if queue:
                msg = queue.popleft()
                if isinstance(msg, p.Error):
                    self._forget(rid)
                    raise ServerError(msg)
                return msg
            if self._unclaimed:
                self._forget(rid)
                raise ServerError(self._unclaimed.popleft())
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(
                    f"no reply from {self.endpoint} for request {rid} within {timeout} s"
                )
            if self._pump(left):
                deadline = None if timeout is None else time.monotonic() + timeout

    def _forget(self, rid: str) -> None:
        self._queues.pop(rid, None)
        self._generating.discard(rid)

    def _call(self, msg: Any, timeout: float | None) -> Any:
        self._queues[msg.request_id] = deque()
        self._send(msg)
        try:
            return self._next(msg.request_id, self.timeout if timeout is None else timeout)
        finally:
            self._forget(msg.request_id)

    # ------------------------------------------------------------------ generation
    def submit(
        self,
        text: str | None = None,
        *,
        stream: bool = False,
        request_id: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> str:
        """Send a generate request and return its id without waiting (see :meth:`events`)."""
        rid = request_id or self._ids.next()
        if rid in self._queues:  # a second waiter would orphan the first
            raise ValueError(f"request id {rid!r} is already in flight on this client")
        req = generate_request(rid, text, stream, options)
        self._queues[rid] = deque()
        self._generating.add(rid)
        self._send(req)
        return rid

    def events(self, request_id: str, timeout: float | None = None) -> Iterator[Event]:
        """Yield a submitted request's chunks, then its :class:`GenerateFinal`.

        Raises :class:`ServerError` on an error reply. Leaving the loop early aborts the request.
        """
        done = False
        try:
            while True:
                msg = self._next(request_id, self.timeout if timeout is None else timeout)
                if isinstance(msg, p.GenerateFinal):
                    done = True
                    self._forget(request_id)
                    yield msg
                    return
                yield msg
        finally:
            if not done and request_id in self._generating:
                self.abort(request_id)

    def result(self, request_id: str, timeout: float | None = None) -> p.GenerateFinal:
        """Wait for a submitted request's final message (chunks are skipped)."""
        for ev in self.events(request_id, timeout):
            if isinstance(ev, p.GenerateFinal):
                return ev
        raise AssertionError("unreachable")

    def generate(self, text: str | None = None, **kwargs: Any) -> p.GenerateFinal:
        """Generate and wait; same arguments as :meth:`submit` (``stream`` is ignored)."""
        kwargs["stream"] = False
        return self.result(self.submit(text, **kwargs))

    def stream(self, text: str | None = None, **kwargs: Any) -> Iterator[Event]:
        """Generate with streaming: yields chunks then the final; breaking out aborts."""
        kwargs["stream"] = True
        return self.events(self.submit(text, **kwargs))

    def abort(self, request_id: str) -> None:
        """Abort a request; the router frees its KV in the worker."""
        if request_id in self._generating:
            self._send(p.Abort(request_id=request_id))
        self._forget(request_id)

    # ------------------------------------------------------------------ control
    def health(self, timeout: float | None = None) -> p.HealthReply:
        return self._call(p.Health(request_id=self._ids.next()), timeout)

    def stats(self, timeout: float | None = None) -> p.StatsReply:
        return self._call(p.StatsRequest(request_id=self._ids.next()), timeout)

    def model_info(self, timeout: float | None = None) -> p.ModelInfo:
        return self._call(p.ModelInfoRequest(request_id=self._ids.next()), timeout)

    def flush_cache(self, timeout: float | None = None) -> bool:
        return self._call(p.FlushCache(request_id=self._ids.next()), timeout).ok

    def load_lora_adapter(
        self, name: str, path: str, timeout: float | None = None
    ) -> p.LoraAdapterReply:
        """Have every worker serve the PEFT adapter at ``path`` (a directory on the workers'
        hosts) as ``name``; the reply says whether they all do (an authenticated client
        only)."""
        msg = p.LoadLoraAdapter(request_id=self._ids.next(), name=name, path=path)
        return self._call(msg, timeout)

    def unload_lora_adapter(self, name: str, timeout: float | None = None) -> p.LoraAdapterReply:
        """Have every worker stop serving adapter ``name`` (its running requests finish)."""
        msg = p.UnloadLoraAdapter(request_id=self._ids.next(), name=name)
        return self._call(msg, timeout)

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, timeout: float | None = None
    ) -> p.UpdateWeightsReply:
        """Have every worker serve the weights of the checkpoint at ``model_path`` (a
        directory on the workers' hosts, of the served architecture), named
        ``weight_version``; each finishes its running requests first and holds new ones
        meanwhile. The reply says whether they all do (an authenticated client only)."""
        msg = p.UpdateWeights(
            request_id=self._ids.next(), model_path=model_path, weight_version=weight_version
        )
        return self._call(msg, timeout)

    def pause_generation(
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
        return self._call(msg, timeout)

    def continue_generation(self, timeout: float | None = None) -> p.PauseReply:
        """Have every worker generate again after :meth:`pause_generation`."""
        msg = p.ContinueGeneration(request_id=self._ids.next())
        return self._call(msg, timeout)

    def release_memory_occupation(
        self, tags: list[p.MemoryTag] | None = None, timeout: float | None = None
    ) -> p.MemoryReply:
        """:meth:`AsyncClient.release_memory_occupation
        <radixserve.serving.client.async_client.AsyncClient.release_memory_occupation>`,
        blocking: the memory of ``tags`` (None: both) given back, requests held until the
        resume; refused while a request runs. An authenticated client only."""
        msg = p.ReleaseMemory(request_id=self._ids.next(), tags=tags)
        return self._call(msg, timeout)

    def resume_memory_occupation(
        self, tags: list[p.MemoryTag] | None = None, timeout: float | None = None
    ) -> p.MemoryReply:
        """Have every worker take the memory of ``tags`` again (None: both); released
        weights stay undefined until :meth:`update_weights_from_disk`."""
        msg = p.ResumeMemory(request_id=self._ids.next(), tags=tags)
        return self._call(msg, timeout)

    def close_session(
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
        return bool(self._call(msg, timeout).released)

    def tokenize(
        self, texts: list[str], timeout: float | None = None, *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of each text, as the router encodes a ``text`` prompt (without the
        tokenizer's special tokens when ``add_special_tokens`` is False)."""
        return self._call(
            p.TokenizeRequest(
                request_id=self._ids.next(),
                texts=list(texts),
                add_special_tokens=add_special_tokens,
            ),
            timeout,
        ).input_ids

    def detokenize(
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
        return str(self._call(msg, timeout).text)

    def tokenize_chat(
        self,
        messages: list[p.ChatMessage],
        timeout: float | None = None,
        **rendering: Unpack[ChatRendering],
    ) -> list[int]:
        """Token ids of the chat prompt ``messages`` render to, as the router encodes a
        ``messages`` prompt."""
        msg = p.TokenizeRequest(request_id=self._ids.next(), messages=list(messages), **rendering)
        (ids,) = self._call(msg, timeout).input_ids
        return list(ids)

    def close(self) -> None:
        """Abort this client's unfinished requests and close the socket."""
        if self._sock.closed:
            return
        for rid in list(self._generating):
            self._send(p.Abort(request_id=rid))
        self._generating.clear()
        self._sock.close(linger=200)  # let the aborts leave

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stream_demo(
    prompt: str,
    *,
    endpoint: str = DEFAULT_ENDPOINT,
    raw: bool = False,
    max_tokens: int = 64,
    temperature: float = 0.0,
    stats: bool = False,
    keys: str | None = None,
) -> int:
    """Streaming demo (``radixserve client``): print a completion as it arrives, then usage
    and timings (and the router's stats with ``stats``). ``raw`` sends the prompt as text,
    not as a chat message; ``keys``: this client's CURVE key directory."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    curve = None
    if keys is not None:
        from radixserve.serving.wire.security import load_peer_keys

        curve = load_peer_keys(keys)
    with Client(endpoint, curve=curve) as client:
        try:
            kwargs: dict[str, Any] = {"params": params}
            if raw:
                kwargs["text"] = prompt
            else:
                kwargs["messages"] = [{"role": "user", "content": prompt}]
            for ev in client.stream(**kwargs):
                if isinstance(ev, p.GenerateChunk):
                    print(ev.text, end="", flush=True)
                else:
                    u, t = ev.usage, ev.timings
                    print(
                        f"\n[{ev.finish_reason}] prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), "
                        f"completion {u.completion_tokens}; ttft {t.ttft_s * 1000:.0f} ms, "
                        f"total {t.total_s * 1000:.0f} ms, worker {ev.worker_id}",
                        file=sys.stderr,
                    )
            if stats:
                import json

                import msgspec

                print(json.dumps(msgspec.to_builtins(client.stats()), indent=2))
        except (ServerError, TimeoutError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0
