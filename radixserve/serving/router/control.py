"""Router control operations that ask every worker and answer once: stats, cache flush,
session close.

A client's :class:`StatsRequest` / :class:`FlushCache` / :class:`CloseSession` fans out to the live workers with a
token; the reply goes back when every one of them answered, died, or the timeout passed
(then with what arrived). Stats therefore reflect the workers' state *after* every message
the router sent them before, e.g. the aborts of a client that left.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from radixserve.serving.router.dispatch import Dispatcher
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire.security import cache_namespace

Kind = Literal["stats", "flush", "close"]


@dataclass(eq=False)
class _Op:
    kind: Kind
    client: bytes
    request_id: str
    waiting: set[int]
    deadline: float
    ok: bool = True


class ControlOps:
    """Fan-out / fan-in of stats and flush requests for one router.

    It asks the workers of ``pool``, clears a flushed worker's routing trie in
    ``dispatcher``, answers clients through ``send_client`` (stats as ``stats_reply``
    builds them), and gives up on a worker after ``timeout_s``.
    """

    def __init__(
        self,
        pool: WorkerPool,
        dispatcher: Dispatcher,
        timeout_s: float,
        send_client: Callable[[bytes, msgspec.Struct], bool],
        stats_reply: Callable[[str], p.StatsReply],
    ) -> None:
        self._pool, self._dispatcher, self._timeout_s = pool, dispatcher, timeout_s
        self._send_client, self._stats_reply = send_client, stats_reply
        self._tokens = itertools.count(1)
        self._ops: dict[int, _Op] = {}

    def start(self, client: bytes, msg: p.StatsRequest | p.FlushCache | p.CloseSession) -> None:
        kind: Kind = (
            "stats"
            if isinstance(msg, p.StatsRequest)
            else "flush"
            if isinstance(msg, p.FlushCache)
            else "close"
        )
        token = next(self._tokens)
        op = _Op(kind, client, msg.request_id, set(), time.monotonic() + self._timeout_s)
        out: p.WorkerStatsRequest | p.WorkerFlush | p.WorkerCloseSession
        if isinstance(msg, p.CloseSession):
            op.ok = False  # "released": some worker held the session's lease
            namespace = cache_namespace(msg.namespace, msg.cache_salt)
            self._dispatcher.forget_session(msg.session_id, namespace)
            out = p.WorkerCloseSession(token=token, session_id=msg.session_id, namespace=namespace)
        elif kind == "stats":
            out = p.WorkerStatsRequest(token=token)
        else:
            out = p.WorkerFlush(token=token)
        self._ops[token] = op
        for w in self._pool.live:
            op.waiting.add(w.worker_id)
            if not self._pool.send(w, out):
                op.waiting.discard(w.worker_id)
        if kind == "flush" and not self._pool.live:
            op.ok = False
        self._maybe_done(token)

    def on_reply(
        self,
        w: WorkerHandle,
        msg: p.WorkerStatsReply | p.WorkerFlushReply | p.WorkerCloseSessionReply,
    ) -> None:
        op = self._ops.get(msg.token)
        if isinstance(msg, p.WorkerCloseSessionReply):
            if op is not None and msg.released:
                op.ok = True
        elif isinstance(msg, p.WorkerStatsReply):
            w.engine, w.load = msg.engine, msg.load
        elif msg.ok:
            tree = self._dispatcher.tries.get(w.worker_id)
            if tree is not None:
                tree.clear()
        if op is None:
            return
        if isinstance(msg, p.WorkerFlushReply) and not msg.ok:
            op.ok = False
        op.waiting.discard(w.worker_id)
        self._maybe_done(msg.token)

    def on_worker_dead(self, w: WorkerHandle) -> None:
        for token in list(self._ops):
            op = self._ops.get(token)
            if op is not None and w.worker_id in op.waiting:
                op.waiting.discard(w.worker_id)
                op.ok = False if op.kind == "flush" else op.ok
                self._maybe_done(token)

    def expire(self, now: float) -> None:
        for token, op in list(self._ops.items()):
            if now >= op.deadline:
                op.ok = op.ok and op.kind == "close"  # a release that happened stays so
                op.waiting.clear()
                self._maybe_done(token)

    def _maybe_done(self, token: int) -> None:
        op = self._ops.get(token)
        if op is None or op.waiting:
            return
        del self._ops[token]
        if op.kind == "stats":
            self._send_client(op.client, self._stats_reply(op.request_id))
        elif op.kind == "close":
            self._send_client(
                op.client, p.CloseSessionReply(request_id=op.request_id, released=op.ok)
            )
        else:
            self._send_client(op.client, p.FlushCacheReply(request_id=op.request_id, ok=op.ok))
