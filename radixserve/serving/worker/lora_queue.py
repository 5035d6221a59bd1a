"""A worker's LoRA adapter loads and unloads, applied in the order the router sent them,
with the adapters' files read off the step loop.

Reading an adapter (its safetensors file, its deltas fused and placed on the device) takes
from milliseconds to seconds; on the step loop it would stall every running request for
that long. So a load's files are read on a thread of this queue (the engine's
``read_lora_adapter``, which changes no engine state) while the loop keeps stepping, and
the adapter is served between two steps once read (``add_lora_adapter``). The router sends
no request naming an adapter before this worker's reply said it serves it.

Order is kept: an operation waits for the ones before it (an unload sent after a load of
the same name is applied after it), each answered with what the worker serves then. A
request naming an adapter with an operation still queued waits for that operation
(:meth:`LoraQueue.settle`, blocking the loop): the router sends a restarted worker the
adapters loaded since start-up and, counting on them, the requests that waited for it
right after; such a worker has nothing running to stall. An engine without these methods
(the tests' fake engines) refuses every operation, as before.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import msgspec

from radixserve.serving.wire import protocol as p

log = logging.getLogger("radixserve.serving.worker")

LoraMessage = p.WorkerLoadLora | p.WorkerUnloadLora


class LoraQueue:
    """The pending LoRA operations of one worker (see the module docstring)."""

    def __init__(self, engine: Any, send: Callable[[msgspec.Struct], None]) -> None:
        self._engine = engine
        self._send = send
        self._pending: deque[tuple[LoraMessage, Future[Any] | None]] = deque()
        self._reader: ThreadPoolExecutor | None = None

    @property
    def waiting(self) -> bool:
        """Whether an operation waits (the loop then polls its socket with a short timeout,
        to apply it soon after its files are read)."""
        return bool(self._pending)

    def submit(self, msg: LoraMessage) -> None:
        """Queue ``msg``; a load's files start being read at once, on the reader thread."""
        read: Future[Any] | None = None
        call = getattr(self._engine, "read_lora_adapter", None)
        if isinstance(msg, p.WorkerLoadLora) and call is not None:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
            read = self._reader.submit(call, msg.name, msg.path)
        self._pending.append((msg, read))
        self.apply_ready()

    def apply_ready(self) -> None:
        """Apply the operations at the head of the queue whose files are read, in order,
        and answer each; between steps only."""
        while self._pending:
            msg, read = self._pending[0]
            if read is not None and not read.done():
                return
            self._pending.popleft()
            error = self._apply(msg, read)
            adapters = dict(getattr(self._engine, "lora_adapters", {}))
            self._send(p.WorkerLoraReply(token=msg.token, error=error, adapters=adapters))

    def settle(self, name: str) -> None:
        """Apply every queued operation up to the last one naming adapter ``name``, waiting
        for their files: a request naming it, sent after them, must see them applied."""
        last = max((i for i, (msg, _) in enumerate(self._pending) if msg.name == name), default=-1)
        for _, read in list(self._pending)[: last + 1]:
            if read is not None:
                wait([read])
        self.apply_ready()

    def _apply(self, msg: LoraMessage, read: Future[Any] | None) -> str | None:
        """Serve the read adapter, or unload; the error in words (None: done)."""
        try:
            if isinstance(msg, p.WorkerLoadLora):
                if read is None:
                    raise ValueError("this worker's engine does not load LoRA adapters")
                key = self._engine.add_lora_adapter(read.result())
                log.info("LoRA adapter %r loaded from %s (%s)", msg.name, msg.path, key)
            else:
                unload = getattr(self._engine, "unload_lora_adapter", None)
                if unload is None:
                    raise ValueError("this worker's engine does not load LoRA adapters")
                unload(msg.name)
                log.info("LoRA adapter %r unloaded", msg.name)
        except Exception as exc:  # an operator's bad path or name must not take the worker down
            error = str(exc) or type(exc).__name__
            log.warning("LoRA adapter %r: %s", msg.name, error)
            return error
        return None

    def close(self) -> None:
        """Stop the reader thread; a read in progress is left to finish on its own."""
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
