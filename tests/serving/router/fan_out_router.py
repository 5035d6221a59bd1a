"""A router's fan-out operations (pauses, memory releases) over a real WorkerPool whose
socket records what it sent, wired as the router wires them, the client's replies kept:
for the tests of one kind of operation each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import msgspec
from recording_backend import RecordingBackend

import radixserve.serving.wire.protocol as p
from radixserve.serving.router.dispatch import Dispatcher
from radixserve.serving.router.worker_pool import WorkerHandle, WorkerPool

HELLO = p.WorkerHello(0, 1000, "m", 64, 32, [0])


class _Ops(Protocol):
    def on_worker_dead(self, w: Any) -> None: ...

    def on_joined(self, w: WorkerHandle) -> None: ...


OpsT = TypeVar("OpsT", bound=_Ops)


class FanOutRouter(Generic[OpsT]):
    """``make(pool, timeout_s, send_client)``'s operations over a WorkerPool (5 s timeout)."""

    def __init__(self, make: Callable[..., OpsT]) -> None:
        self.backend = RecordingBackend()
        self.replies: list[Any] = []
        self.pool = WorkerPool(
            self.backend,  # type: ignore[arg-type]
            Dispatcher(),
            on_dead=lambda w, reason: self.ops.on_worker_dead(w),
            on_joined=lambda w: self.ops.on_joined(w),
        )
        self.ops: OpsT = make(self.pool, 5.0, self._reply)

    def _reply(self, client: bytes, msg: msgspec.Struct) -> bool:
        self.replies.append(msg)
        return True

    def join(self, wid: int, **hello: Any) -> WorkerHandle:
        """Worker ``wid`` joins, its hello's other fields ``hello``."""
        said = msgspec.structs.replace(HELLO, worker_id=wid, **hello)
        return self.pool.register(f"w{wid}".encode(), said)

    def sent(self) -> list[Any]:
        return [m for _, m in self.backend.take()]
