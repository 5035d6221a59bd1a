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

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from radixserve.serving.router.fan_out import ReportedOp, ReportingFanOut
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool
from radixserve.serving.wire import protocol as p

log = logging.getLogger("radixserve.serving.router")

LoraRequest = p.LoadLoraAdapter | p.UnloadLoraAdapter


@dataclass(eq=False)
class _Op(ReportedOp):
    msg: LoraRequest
    answered: dict[int, dict[str, str]] = field(default_factory=dict)  # worker -> its adapters
    refused: int = 0  # workers that answered with an error


class LoraOps(ReportingFanOut[_Op, WorkerPool]):
    """Fan-out / fan-in of adapter loads and unloads for one router, and their replay to
    workers that join (see the module docstring)."""

    def __init__(
        self,
        pool: WorkerPool,
        timeout_s: float,
        send_client: Callable[[bytes, msgspec.Struct], bool],
    ) -> None:
        super().__init__(pool, timeout_s, send_client)
        # What changed while serving, replayed to joining workers: name -> (path, cache
        # key) of what was loaded; the names unloaded since.
        self._loaded: dict[str, tuple[str, str]] = {}
        self._unloaded: set[str] = set()

    def start(self, client: bytes, msg: LoraRequest) -> None:
        op = _Op(client, set(), self._deadline(), msg)
        self._maybe_done(self._ask_live(op, lambda token: _worker_message(msg, token)))

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

    def _finish(self, op: _Op) -> None:
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


def _worker_message(msg: LoraRequest, token: int) -> p.WorkerLoadLora | p.WorkerUnloadLora:
    if isinstance(msg, p.LoadLoraAdapter):
        return p.WorkerLoadLora(token=token, name=msg.name, path=msg.path)
    return p.WorkerUnloadLora(token=token, name=msg.name)


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
