"""What the router's operations that ask every live worker share (control.py's stats,
flushes and session closes; lora_ops.py's adapter loads and unloads; weight_ops.py's
weight updates): a token per operation, the workers it waits on, and its end when every
one of them answered, died, or the timeout passed. What each answer means and what goes
back to the client are the subclass's (:meth:`FanOut._lost`, :meth:`FanOut._timed_out`,
:meth:`FanOut._finish`); :class:`ReportingFanOut` writes the first two for operations
whose reply says, in words, which worker failed them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import msgspec


class Worker(Protocol):
    """What a fan-out reads of a worker (worker_pool.WorkerHandle)."""

    worker_id: int


class Workers(Protocol):
    """What a fan-out needs of the router's workers (worker_pool.WorkerPool): this module
    stays below the pool, so the operations built on it sit no deeper than before."""

    @property
    def live(self) -> Sequence[Worker]: ...

    def send(self, w: Any, msg: msgspec.Struct) -> bool: ...


@dataclass(eq=False)
class FanOutOp:
    """One operation: the client to answer, the workers it waits on, when it gives up."""

    client: bytes
    waiting: set[int]
    deadline: float


OpT = TypeVar("OpT", bound=FanOutOp)
PoolT = TypeVar("PoolT", bound=Workers)


class FanOut(Generic[OpT, PoolT]):
    """Operations of one kind over ``pool``'s live workers, given up after ``timeout_s``;
    ``send_client`` answers the client that asked."""

    def __init__(
        self,
        pool: PoolT,
        timeout_s: float,
        send_client: Callable[[bytes, msgspec.Struct], bool],
    ) -> None:
        self._pool, self._timeout_s, self._send_client = pool, timeout_s, send_client
        self._tokens = itertools.count(1)
        self._ops: dict[int, OpT] = {}

    def _deadline(self) -> float:
        return time.monotonic() + self._timeout_s

    def _ask_live(self, op: OpT, message: Callable[[int], msgspec.Struct]) -> int:
        """Send ``message(token)`` to every live worker and wait on those it reached; the
        token. The caller ends the operation with :meth:`_maybe_done` (none may be live)."""
        token = next(self._tokens)
        self._ops[token] = op
        out = message(token)
        for w in self._pool.live:
            op.waiting.add(w.worker_id)
            if not self._pool.send(w, out):
                op.waiting.discard(w.worker_id)
        return token

    def on_worker_dead(self, w: Worker) -> None:
        for token, op in list(self._ops.items()):
            if w.worker_id in op.waiting:
                op.waiting.discard(w.worker_id)
                self._lost(op, w)
                self._maybe_done(token)

    def expire(self, now: float) -> None:
        for token, op in list(self._ops.items()):
            if now >= op.deadline:
                self._timed_out(op)
                op.waiting.clear()
                self._maybe_done(token)

    def _maybe_done(self, token: int) -> None:
        op = self._ops.get(token)
        if op is None or op.waiting:
            return
        del self._ops[token]
        self._finish(op)

    def _lost(self, op: OpT, w: Worker) -> None:
        """``w`` died before it answered ``op``."""

    def _timed_out(self, op: OpT) -> None:
        """``op``'s time ran out; ``op.waiting`` are the workers that did not answer."""

    def _finish(self, op: OpT) -> None:
        """Answer ``op``'s client: every worker answered, died or ran out of time."""
        raise NotImplementedError


@dataclass(eq=False)
class ReportedOp(FanOutOp):
    """An operation whose reply lists, in words, what went wrong on which worker, and how
    many workers answered it."""

    errors: list[str] = field(default_factory=list, kw_only=True)
    replies: int = field(default=0, kw_only=True)


ReportedT = TypeVar("ReportedT", bound=ReportedOp)


class ReportingFanOut(FanOut[ReportedT, PoolT]):
    """A fan-out whose lost and silent workers are reported in the operation's errors."""

    def _lost(self, op: ReportedT, w: Worker) -> None:
        op.errors.append(f"worker {w.worker_id} died before it answered")

    def _timed_out(self, op: ReportedT) -> None:
        op.errors += [
            f"worker {wid} did not answer within {self._timeout_s:g} s"
            for wid in sorted(op.waiting)
        ]

    def _answered(self, w: Worker, token: int, error: str | None) -> ReportedT | None:
        """Count ``w``'s answer to operation ``token`` (its ``error``, if any): the
        operation, or None where none waits on that answer. The caller folds in the rest of
        the reply, then ends the operation with :meth:`_maybe_done`."""
        op = self._ops.get(token)
        if op is None or w.worker_id not in op.waiting:
            return None
        op.waiting.discard(w.worker_id)
        op.replies += 1
        if error is not None:
            op.errors.append(f"worker {w.worker_id}: {error}")
        return op

    @staticmethod
    def _code(op: ReportedT) -> str | None:
        """The reply's error code: ``unavailable`` where no worker answered, ``invalid_params``
        where any refused, None where all did it."""
        if not op.replies:
            op.errors = op.errors or ["no live worker"]
            return "unavailable"
        return "invalid_params" if op.errors else None
