"""``EngineBackend``: run programs on an in-process ``radixserve.engine.Engine``.

The engine is single-threaded; programs are many threads. One driver thread owns the
engine: it takes new requests and aborts from an inbox, runs ``engine.step()`` while
anything is unfinished, and routes each ``StepOutput`` to the queue of the call that
owns it. So every program's calls land in the same scheduler steps — forks and batch
members decode together and share cached prefixes — exactly as they would in a worker.

```
 program threads ──(add / abort)──> inbox ──> driver thread: engine.step() ──> per-request queues ──> GenStream
```

Prompts are tokenized by ``encode_text`` (the router's rule for text
prompts), and text is produced by the engine's ``IncrementalDetokenizer`` (stop strings
cut, a matched stop aborts the request), so a program sees the same text and the same
token ids as over ``RemoteBackend``. Importing this module imports torch.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import msgspec

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
from radixserve.serving.prompts import encode_text

__all__ = ["EngineBackend"]

T = TypeVar("T")

_CLOSE = object()


def _usage(o: Any) -> CallUsage | None:
    u = getattr(o, "usage", None)
    return None if u is None else CallUsage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)


class _EngineStream(GenStream):
    """Chunks of one engine request, detokenized in the consumer's thread."""

    def __init__(
        self,
        backend: EngineBackend,
        rid: str,
        outputs: queue.Queue[Any],
        params: SamplingParams,
        prompt_ids: list[int],
    ) -> None:
        from radixserve.engine.detokenizer import IncrementalDetokenizer

        self._backend, self._rid, self._outputs = backend, rid, outputs
        self._detok = IncrementalDetokenizer(backend.tokenizer, params, prompt_ids)
        self._done = False

    def __iter__(self) -> Iterator[GenChunk]:
        usage: CallUsage | None = None
        completion = 0
        while not self._done:
            o = self._outputs.get()
            if isinstance(o, BaseException):
                self._done = True
                yield GenChunk(finished=True, finish_reason="error", error=repr(o))
                return
            usage = _usage(o) or usage
            completion += len(o.new_token_ids)
            with self._backend._tok_lock:
                delta = self._detok.add(o.new_token_ids, final=o.finished)
            if delta.stopped and not o.finished:
                # A stop string matched: the text is final, free the request's KV now.
                self.close()
                self._done = True
                if usage is not None:
                    usage = CallUsage(usage.prompt_tokens, usage.cached_tokens, completion)
                yield GenChunk(text=delta.text, finished=True, finish_reason="stop", usage=usage)
                return
            if o.finished:
                self._done = True
                reason = "stop" if delta.stopped else o.finish_reason
                yield GenChunk(
                    text=delta.text, finished=True, finish_reason=reason, usage=usage, error=o.error
                )
                return
            if delta.text:
                yield GenChunk(text=delta.text)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._backend._abort(self._rid)


class EngineBackend(Backend):
    """A ``Backend`` over an ``Engine`` in this process.

    Pass an existing engine, or a model (``None``/"default" for SmolLM2, or a local
    checkpoint directory) and ``EngineConfig`` options to build one.
    """

    def __init__(
        self, engine: Any = None, *, model: str | Path | None = None, **engine_config: Any
    ) -> None:
        if engine is None:
            from radixserve.engine import Engine

            engine = Engine(model, **engine_config)
        elif engine_config or model is not None:
            raise TypeError("pass either an engine or a model with engine options, not both")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sinks: dict[str, queue.Queue[Any]] = {}  # owned by the driver thread
        self._ids = itertools.count()
        self._closed = False
        # Held while checking _closed and queueing: nothing can be queued behind the close
        # command, where the driver (gone by then) would never answer it.
        self._gate = threading.Lock()
        self._info: ModelInfo | None = None
        self._sessions = OpenSessions()
        self._driver = threading.Thread(target=self._drive, name="dsl-engine-driver", daemon=True)
        self._driver.start()

    # ------------------------------------------------------------------ driver thread
    def _drive(self) -> None:
        engine = self.engine
        while True:
            # Block for work only when the engine is idle; otherwise just drain the inbox.
            try:
                cmd = self._inbox.get(block=not engine.has_unfinished())
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd is _CLOSE:
                    self._fail_all(BackendError("the engine backend was closed"))
                    return
                self._handle(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - every waiting call learns of it
                self._fail_all(BackendError(f"engine step failed: {exc!r}"))
                continue
            for o in outputs:
                sink = self._sinks.get(o.request_id)
                if sink is not None:
                    sink.put(o)
                    if o.finished:
                        del self._sinks[o.request_id]

    def _handle(self, cmd: tuple[Any, ...]) -> None:
        if cmd[0] == "add":
            _, rid, ids, params, sink, session = cmd
            try:
                self.engine.add_request(ids, params, request_id=rid, session_id=session)
            except Exception as exc:  # noqa: BLE001 - invalid params, prompt too long, ...
                sink.put(exc)
                return
            self._sinks[rid] = sink
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
        elif cmd[0] == "call":
            _, fn, future = cmd
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, sink in list(self._sinks.items()):
            sink.put(exc)
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - best effort; the engine may be broken
                pass
        self._sinks.clear()

    def _put(self, cmd: tuple[Any, ...]) -> bool:
        """Queue a command for the driver; False once the backend is closed."""
        with self._gate:
            if self._closed:
                return False
            self._inbox.put(cmd)
            return True

    def _submit(
        self, ids: list[int], params: SamplingParams, session: str | None
    ) -> tuple[str, queue.Queue[Any]]:
        rid = f"dsl-{next(self._ids)}"
        sink: queue.Queue[Any] = queue.Queue()
        if not self._put(("add", rid, ids, params, sink, session)):
            raise BackendError("the engine backend is closed")
        self._sessions.add(session)
        return rid, sink

    def _abort(self, rid: str) -> None:
        self._put(("abort", rid))

    # ------------------------------------------------------------------ Backend
    def model_info(self) -> ModelInfo:
        if self._info is None:
            tok, mc = self.tokenizer, self.engine.model_config
            special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
            self._info = ModelInfo(
                model=str(getattr(self.engine, "model_path", "engine")),
                chat_template=getattr(tok, "chat_template", None),
                special_tokens=special,
                vocab_size=mc.vocab_size,
                eos_token_ids=tuple(mc.eos_token_ids),
                max_context=getattr(self.engine, "max_total_len", None),
            )
        return self._info

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        with self._tok_lock:
            return [encode_text(self.tokenizer, t) for t in texts]

    def generate(
        self,
        prompt: str,
        params: SamplingParams,
        *,
        program_id: str | None = None,
        prediction: str | None = None,
    ) -> GenStream:
        params = params.validate()
        if prediction:  # as the router encodes one: no special tokens, as the answer holds it
            with self._tok_lock:
                predicted = encode_text(self.tokenizer, prediction, add_special_tokens=False)
            params = msgspec.structs.replace(params, prediction=predicted).validate()
        ids = self.tokenize([prompt])[0]
        rid, sink = self._submit(ids, params, program_id)
        return _EngineStream(self, rid, sink, params, ids)

    def score(
        self, requests: list[ScoreRequest], *, program_id: str | None = None
    ) -> list[ScoreResult]:
        sinks = [
            self._submit(
                list(r.token_ids),
                SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs_start=r.start),
                program_id,
            )
            for r in requests
        ]
        results = []
        for _req, (_rid, sink) in zip(requests, sinks):
            logprobs: list[float | None] | None = None
            usage: CallUsage | None = None
            while True:
                o = sink.get()
                if isinstance(o, BaseException):
                    raise BackendError(f"scoring failed: {o!r}") from o
                if o.prompt_logprobs is not None:
                    logprobs = o.prompt_logprobs
                usage = _usage(o) or usage
                if o.finished:
                    break
            if o.finish_reason == "error" or logprobs is None:
                raise BackendError(f"scoring failed: {o.error or 'no prompt logprobs returned'}")
            results.append(
                ScoreResult(
                    logprobs=[float(x) for x in logprobs if x is not None],
                    usage=usage or CallUsage(),
                )
            )
        return results

    def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on the driver thread, between steps, and return its result.

        The engine is not thread-safe: touch it only this way while programs run (e.g.
        ``backend.call(lambda e: e.stats())``).
        """
        future: Future[T] = Future()
        if not self._put(("call", fn, future)):
            raise BackendError("the engine backend is closed")
        return future.result()

    def close_session(self, program_id: str) -> bool:
        """Release the program's session lease in the engine (between two steps)."""
        if not self._sessions.discard(program_id):
            return False  # this backend sent nothing for it, or closed it already
        return bool(self.call(lambda engine: engine.close_session(program_id)))

    def flush_cache(self) -> bool:
        """Drop the engine's cached prefixes (False while requests are running)."""
        return self.call(lambda engine: engine.flush_cache())

    def stats(self) -> Any:
        """The engine's ``EngineStats``."""
        return self.call(lambda engine: engine.stats())

    def close(self) -> None:
        """Close the sessions still open, stop the driver thread (unfinished calls fail);
        the engine itself stays usable."""
        open_ids = self._sessions.drain()  # runs that never reached their end
        if open_ids:
            try:
                self.call(lambda engine: [engine.close_session(pid) for pid in open_ids])
            except BackendError:
                pass  # closed meanwhile by another thread
        with self._gate:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_CLOSE)
        self._driver.join(timeout=30)
