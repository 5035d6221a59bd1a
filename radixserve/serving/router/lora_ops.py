"""Loading and unloading LoRA adapters on every worker while serving (SGLang's and vLLM's
``/load_lora_adapter`` and ``/unload_lora_adapter``).

A client's :class:`~radixserve.serving.wire.protocol.LoadLoraAdapter` or
:class:`~radixserve.serving.wire.protocol.UnloadLoraAdapter` fans out to the live workers
with a token; each answers with the adapters it serves afterwards, which become the
router's view of it (requests naming an adapter are taken only while every live worker
serves it: ``WorkerPool.lora_adapters``). The reply goes back when every one answered, died,
or the timeout passed, ``ok`` when every worker that answered serves the adapter (a load)
or none does (an unload).

A worker that joins later (a restart starts from its ``--lora-paths``) is sent what was
loaded and unloaded since, before any request can reach it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool
from radixserve.serving.wire import protocol as p

log = logging.getLogger("radixserve.serving.router")

LoraRequest = p.LoadLoraAdapter | p.UnloadLoraAdapter


@dataclass(eq=False)
class _Op:
    client: bytes
    msg: LoraRequest
    waiting: set[int]
    deadline: float
    answered: dict[int, dict[str, str]] = field(default_factory=dict)  # worker -> its adapters
    errors: list[str] = field(default_factory=list)
    refused: int = 0  # workers that answered with an error


class LoraOps:
    """Fan-out / fan-in of adapter loads and unloads for one router, and their replay to
    workers that join (see the module docstring)."""

    def __init__(
        self,
        pool: WorkerPool,
        timeout_s: float,
        send_client: Callable[[bytes, msgspec.Struct], bool],
    ) -> None:
        self._pool, self._timeout_s, self._send_client = pool, timeout_s, send_client
        self._tokens = itertools.count(1)
        self._ops: dict[int, _Op] = {}
        # What changed while serving, replayed to joining workers: name -> (path, cache
        # key) of what was loaded; the names unloaded since.
        self._loaded: dict[str, tuple[str, str]] = {}
        self._unloaded: set[str] = set()

    def start(self, client: bytes, msg: LoraRequest) -> None:
        token = next(self._tokens)
        op = _Op(client, msg, set(), time.monotonic() + self._timeout_s)
        out = (
            p.WorkerLoadLora(token=token, name=msg.name, path=msg.path)
            if isinstance(msg, p.LoadLoraAdapter)
            else p.WorkerUnloadLora(token=token, name=msg.name)
        )
        self._ops[token] = op
        for w in self._pool.live:
            op.waiting.add(w.worker_id)
            if not self._pool.send(w, out):
                op.waiting.discard(w.worker_id)
        self._maybe_done(token)

    def on_reply(self, w: WorkerHandle, msg: p.WorkerLoraReply) -> None:
        w.lora_adapters = dict(msg.adapters)
        if msg.token == 0 and msg.error is not None:
            log.warning("worker %d: replaying a LoRA change failed: %s", w.worker_id, msg.error)
        op = self._ops.get(msg.token)
        if op is None or w.worker_id not in op.waiting:
            return
        op.waiting.discard(w.worker_id)
        op.answered[w.worker_id] = w.lora_adapters
        if msg.error is not None:
            op.refused += 1
            op.errors.append(f"worker {w.worker_id}: {msg.error}")
        self._maybe_done(msg.token)

    def on_joined(self, w: WorkerHandle) -> None:
        """Send a joining worker what was loaded and unloaded since start-up; the router
        counts on it meanwhile (its replies correct that where a change fails there)."""
        for name, (path, key) in self._loaded.items():
            if w.lora_adapters.get(name) != key:
                self._pool.send(w, p.WorkerLoadLora(token=0, name=name, path=path))
                w.lora_adapters[name] = key
        for name in self._unloaded & set(w.lora_adapters):
            self._pool.send(w, p.WorkerUnloadLora(token=0, name=name))
            del w.lora_adapters[name]

    def on_worker_dead(self, w: WorkerHandle) -> None:
        for token, op in list(self._ops.items()):
            if w.worker_id in op.waiting:
                op.waiting.discard(w.worker_id)
                op.errors.append(f"worker {w.worker_id} died before it answered")
                self._maybe_done(token)

    def expire(self, now: float) -> None:
        for token, op in list(self._ops.items()):
            if now >= op.deadline:
                op.errors += [
                    f"worker {wid} did not answer within {self._timeout_s:g} s"
                    for wid in sorted(op.waiting)
                ]
                op.waiting.clear()
                self._maybe_done(token)

    def _maybe_done(self, token: int) -> None:
        op = self._ops.get(token)
        if op is None or op.waiting:
            return
        del self._ops[token]
        code = _failure(op)
        if code is None:
            self._record(op)
        elif not op.errors:
            op.errors.append("no live worker")
        reply = p.LoraAdapterReply(
            request_id=op.msg.request_id,
            ok=code is None,
            code=code,
            error="; ".join(op.errors) or None,
            adapters=self._pool.lora_adapters() or {},
        )
        self._send_client(op.client, reply)

    def _record(self, op: _Op) -> None:
        """Remember a change every worker made, for the workers that join later."""
        name = op.msg.name
        if isinstance(op.msg, p.LoadLoraAdapter):
            key = next(iter(op.answered.values()))[name]
            self._loaded[name] = (op.msg.path, key)
            self._unloaded.discard(name)
        else:
            self._loaded.pop(name, None)
            self._unloaded.add(name)


def _failure(op: _Op) -> str | None:
    """Why ``op`` failed, as the reply's ``code`` (None: it did not). A load succeeded where
    every worker that answered loaded it; an unload, where none serves it now and some
    worker did (an unknown name is ``not_found``)."""
    answers = list(op.answered.values())
    if not answers:
        return "unavailable"
    if isinstance(op.msg, p.LoadLoraAdapter):
        done = not op.errors and all(op.msg.name in a for a in answers)
        return None if done else "invalid_params"
    if op.refused == len(answers):
        return "not_found"
    return None if all(op.msg.name not in a for a in answers) else "invalid_params"
