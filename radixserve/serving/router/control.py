"""Router control operations that ask every worker and answer once: stats, cache flush,
session close.

A client's :class:`StatsRequest` / :class:`FlushCache` / :class:`CloseSession` fans out to the live workers with a
token; the reply goes back when every one of them answered, died, or the timeout passed
(then with what arrived). Stats therefore reflect the workers' state *after* every message
the router sent them before, e.g. the aborts of a client that left.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from radixserve.serving.router.dispatch import Dispatcher
from radixserve.serving.router.fan_out import FanOut, FanOutOp, Worker
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire.security import cache_namespace

Kind = Literal["stats", "flush", "close"]


@dataclass(eq=False)
class _Op(FanOutOp):
    kind: Kind
    request_id: str
    ok: bool = True


class ControlOps(FanOut[_Op, WorkerPool]):
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
        super().__init__(pool, timeout_s, send_client)
        self._dispatcher, self._stats_reply = dispatcher, stats_reply

    def start(self, client: bytes, msg: p.StatsRequest | p.FlushCache | p.CloseSession) -> None:
        kind: Kind = (
            "stats"
            if isinstance(msg, p.StatsRequest)
            else "flush"
            if isinstance(msg, p.FlushCache)
            else "close"
        )
        op = _Op(client, set(), self._deadline(), kind, msg.request_id)
        namespace = None
        if isinstance(msg, p.CloseSession):
            op.ok = False  # "released": some worker held the session's lease
            namespace = cache_namespace(msg.namespace, msg.cache_salt)
            self._dispatcher.forget_session(msg.session_id, namespace)
        token = self._ask_live(op, lambda token: _worker_message(msg, token, namespace))
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

    def _lost(self, op: _Op, w: Worker) -> None:
        op.ok = False if op.kind == "flush" else op.ok

    def _timed_out(self, op: _Op) -> None:
        op.ok = op.ok and op.kind == "close"  # a release that happened stays so

    def _finish(self, op: _Op) -> None:
        if op.kind == "stats":
            self._send_client(op.client, self._stats_reply(op.request_id))
        elif op.kind == "close":
            self._send_client(
                op.client, p.CloseSessionReply(request_id=op.request_id, released=op.ok)
            )
        else:
            self._send_client(op.client, p.FlushCacheReply(request_id=op.request_id, ok=op.ok))


def _worker_message(
    msg: p.StatsRequest | p.FlushCache | p.CloseSession, token: int, namespace: str | None
) -> p.WorkerStatsRequest | p.WorkerFlush | p.WorkerCloseSession:
    """What the workers are asked for ``msg`` (``namespace``: a closed session's)."""
    if isinstance(msg, p.CloseSession):
        return p.WorkerCloseSession(token=token, session_id=msg.session_id, namespace=namespace)
    if isinstance(msg, p.StatsRequest):
        return p.WorkerStatsRequest(token=token)
    return p.WorkerFlush(token=token)
