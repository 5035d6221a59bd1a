"""A worker's memory released and resumed (SGLang's ``release_memory_occupation`` /
``resume_memory_occupation``, vLLM's ``/sleep`` / ``/wake_up``): what an RL loop does
around a training step on a machine shared with the trainer.

The engine gives the memory of the tags asked back to the OS
(``Engine.release_memory_occupation``, :mod:`~radixserve.engine.memory_occupation`): the KV
cache (flushed, its pool reading as zeros) or the weights (undefined until the next weight
update). It refuses while a request runs: pause with ``retract`` or ``abort`` first. While
anything is released the worker runs no step and holds every request that comes
(worker/held.py, a holder of its own beside a pause's) until the last tag is resumed; a
weight update applies meanwhile as soon as no request holds KV (the released KV cache is
no obstacle; released weights refuse it until they are resumed).

Refused with prefill/decode disaggregation: a peer may be reading or writing this pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from radixserve.serving.wire import protocol as p
from radixserve.serving.worker.held import HeldRequests

log = logging.getLogger("radixserve.serving.worker")


class Sleeping:
    """One worker's released memory (see the module docstring)."""

    HOLDER = "sleep"

    def __init__(
        self,
        engine: Any,
        send: Callable[[msgspec.Struct], None],
        held: HeldRequests,
        disaggregated: bool = False,
    ) -> None:
        self._engine, self._send, self._held = engine, send, held
        self._disaggregated = disaggregated
        self._released: set[str] = set()

    @property
    def released(self) -> list[p.MemoryTag]:
        """The tags released now, in :data:`~radixserve.serving.wire.protocol.MEMORY_TAGS`' order."""
        return [t for t in p.MEMORY_TAGS if t in self._released]

    @property
    def stepping(self) -> bool:
        """Whether the engine may run steps (nothing released)."""
        return not self._released

    def weights_ready(self) -> bool:
        """Whether a weight update may apply now while asleep: no request holds KV."""
        has_running = getattr(self._engine, "has_running", self._engine.has_unfinished)
        return bool(self._released) and not has_running()

    def release(self, msg: p.WorkerReleaseMemory) -> None:
        """Give the memory of ``msg.tags`` back, then hold the requests that come."""
        freed, error = 0, self._refusal()
        if error is None:
            try:
                freed = int(self._engine.release_memory_occupation(msg.tags))
            except ValueError as exc:  # requests running, several ranks, off the CPU
                error = str(exc)
        if error is None:
            self._released |= set(msg.tags)
            if self._released:  # an empty list of tags releases nothing, and holds nothing
                self._held.hold_for(self.HOLDER)
            log.info("memory released (%s): %.0f MiB", ", ".join(msg.tags), freed / 2**20)
        self._reply(msg.token, error, freed)

    def resume(self, msg: p.WorkerResumeMemory) -> None:
        """Take the memory of ``msg.tags`` again; with none left released the held
        requests start."""
        error = self._refusal()
        if error is None:
            self._engine.resume_memory_occupation(msg.tags)
            self._released -= set(msg.tags)
            if not self._released:
                self._held.release(self.HOLDER)
            log.info("memory resumed (%s)", ", ".join(msg.tags))
        self._reply(msg.token, error)

    def _refusal(self) -> str | None:
        if self._disaggregated:
            return "releasing memory is not supported with prefill/decode disaggregation"
        if not hasattr(self._engine, "release_memory_occupation"):
            return "this worker's engine cannot release its memory"
        return None

    def _reply(self, token: int, error: str | None, freed: int = 0) -> None:
        self._send(
            p.WorkerMemoryReply(token=token, error=error, released=self.released, freed_bytes=freed)
        )
