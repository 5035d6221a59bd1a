"""``RemoteBackend``: run programs against a radixserve router over ZeroMQ.

All program threads share one connection pool: ``connections`` asyncio clients (one
DEALER socket each, default 1) driven by a single event-loop thread. A ``generate``
call becomes a task on that loop streaming into a thread-safe queue the program's
runner reads; closing the stream cancels the task, which aborts the request in the
router (and frees its KV in the worker).

Every call carries the program id as the request's ``session_id``: the router keeps a
program's calls — and its forks' — on one worker, where their shared prefix is cached and
leased between calls; ``close_session`` (a program's end, or this backend's close for the
sessions still open) releases the lease on every worker.
Prompts go as ``text`` (the router tokenizes them exactly as ``EngineBackend`` does);
``select`` scoring sends token ids with ``prompt_logprobs_start``. Torch-free.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from frontend_dsl.backend import (
    Backend,
    BackendError,
    CallUsage,
    GenChunk,
    GenStream,
    ModelInfo,
    OpenSessions,
    ScoreRequest,
    ScoreResult,
)
from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import DEFAULT_ENDPOINT, AsyncClient
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire.security import PeerKeys

__all__ = ["RemoteBackend"]

T = TypeVar("T")


def _usage(u: p.Usage) -> CallUsage:
    return CallUsage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _RemoteStream(GenStream):
    """One streamed request: a task on the backend's loop feeding a queue."""

    def __init__(
        self,
        backend: RemoteBackend,
        prompt: str,
        params: SamplingParams,
        program_id: str | None,
        prediction: str | None,
    ) -> None:
        self._chunks: queue.Queue[GenChunk] = queue.Queue()
        self._done = False
        self._future: Future[None] = backend._spawn(
            self._pump(backend._pick(), prompt, params, program_id, prediction)
        )

    async def _pump(
        self,
        client: AsyncClient,
        prompt: str,
        params: SamplingParams,
        program_id: str | None,
        prediction: str | None,
    ) -> None:
        streamed = ""
        options: dict[str, Any] = {} if prediction is None else {"prediction": prediction}
        try:
            async for ev in client.stream(
                text=prompt, params=params, session_id=program_id, **options
            ):
                if isinstance(ev, p.GenerateChunk):
                    if ev.text:
                        streamed += ev.text
                        self._chunks.put(GenChunk(text=ev.text))
                    continue
                # The final carries the whole text; pass on whatever the chunks did not.
                tail = ev.text[len(streamed) :] if ev.text.startswith(streamed) else ""
                self._chunks.put(
                    GenChunk(
                        text=tail,
                        finished=True,
                        finish_reason=ev.finish_reason,
                        usage=_usage(ev.usage),
                        worker_id=ev.worker_id,
                    )
                )
        except asyncio.CancelledError:
            self._chunks.put(GenChunk(finished=True, finish_reason="abort"))
            raise
        except Exception as exc:  # noqa: BLE001 - ServerError, TimeoutError, ZMQ errors
            self._chunks.put(GenChunk(finished=True, finish_reason="error", error=_describe(exc)))

    def __iter__(self) -> Iterator[GenChunk]:
        while not self._done:
            chunk = self._chunks.get()
            if chunk.finished:
                self._done = True
            yield chunk

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._future.cancel()  # cancels the task; the client's stream sends an Abort


class RemoteBackend(Backend):
    """A ``Backend`` over a radixserve router at ``endpoint``.

    ``timeout``: seconds without any reply from the router before a call fails (the router
    sends keep-alives while requests run). ``connections``: sockets in the shared pool.
    ``curve``: client keys for a router that requires them (``load_peer_keys("keys/client")``).
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        timeout: float | None = 120.0,
        connections: int = 1,
        curve: PeerKeys | None = None,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.endpoint = endpoint
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="dsl-remote-loop", daemon=True
        )
        self._thread.start()
        self._closed = False
        self._info: ModelInfo | None = None
        self._sessions = OpenSessions()

        async def connect() -> list[AsyncClient]:
            return [AsyncClient(endpoint, timeout=timeout, curve=curve) for _ in range(connections)]

        self._clients = self._call(connect())
        self._next = itertools.count()

    # ------------------------------------------------------------------ plumbing
    def _spawn(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if self._closed:
            coro.close()
            raise BackendError("the remote backend is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return self._spawn(coro).result()
        except BackendError:
            raise
        except Exception as exc:  # noqa: BLE001 - one error type for programs to handle
            raise BackendError(f"{self.endpoint}: {_describe(exc)}") from exc

    def _pick(self) -> AsyncClient:
        return self._clients[next(self._next) % len(self._clients)]

    # ------------------------------------------------------------------ Backend
    def model_info(self) -> ModelInfo:
        if self._info is None:
            info = self._call(self._pick().model_info())
            self._info = ModelInfo(
                model=info.model,
                chat_template=info.chat_template,
                special_tokens=dict(info.special_tokens),
                vocab_size=info.vocab_size,
                eos_token_ids=tuple(info.eos_token_ids),
                max_context=info.context_length,
            )
        return self._info

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self._call(self._pick().tokenize(list(texts)))

    def generate(
        self,
        prompt: str,
        params: SamplingParams,
        *,
        program_id: str | None = None,
        prediction: str | None = None,
    ) -> GenStream:
        stream = _RemoteStream(self, prompt, params.validate(), program_id, prediction)
        self._sessions.add(program_id)
        return stream

    def score(
        self, requests: list[ScoreRequest], *, program_id: str | None = None
    ) -> list[ScoreResult]:
        async def one(req: ScoreRequest) -> ScoreResult:
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs_start=req.start)
            final = await self._pick().generate(
                input_ids=list(req.token_ids), params=params, session_id=program_id
            )
            if final.prompt_logprobs is None:
                raise BackendError("the router returned no prompt logprobs")
            return ScoreResult(
                logprobs=[float(x) for x in final.prompt_logprobs if x is not None],
                usage=_usage(final.usage),
            )

        async def all_of() -> list[ScoreResult]:
            return list(await asyncio.gather(*(one(r) for r in requests)))

        self._sessions.add(program_id)
        return self._call(all_of())

    def close_session(self, program_id: str) -> bool:
        """Release the program's session lease on every worker (a round trip to the router)."""
        if not self._sessions.discard(program_id):
            return False  # this backend sent nothing for it, or closed it already
        return bool(self._call(self._pick().close_session(program_id)))

    def health(self, timeout: float = 5.0) -> p.HealthReply:
        """Ask the router whether it is up (``BackendError`` when it does not answer in ``timeout`` s)."""
        return self._call(self._pick().health(timeout=timeout))

    def stats(self) -> p.StatsReply:
        """The router's stats (per-worker hit rates, loads)."""
        return self._call(self._pick().stats())

    def flush_cache(self) -> bool:
        """Drop every worker's unreferenced cached prefixes."""
        return self._call(self._pick().flush_cache())

    def close(self) -> None:
        """Close the sessions still open, abort unfinished calls, close the sockets, stop the
        loop thread. Idempotent."""
        if self._closed:
            return

        async def shutdown() -> None:
            for program_id in self._sessions.drain():  # runs that never reached their end
                try:
                    await self._clients[0].close_session(program_id, timeout=5.0)
                except Exception:  # noqa: BLE001 - the router may be gone already
                    break
            for client in self._clients:
                await client.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - closing must not fail
            pass
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
