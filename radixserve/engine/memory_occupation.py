"""An engine's memory given back to the OS between uses and taken again (SGLang's
``release_memory_occupation`` / ``resume_memory_occupation``, vLLM's ``sleep`` /
``wake_up``): what RL frameworks (verl, OpenRLHF, slime) call around a training step on a
machine shared with the trainer.

Two parts, by SGLang's tags (:data:`MEMORY_TAGS`):

* ``kv_cache``: every cached prefix is dropped (``flush_cache`` with waiting requests
  allowed: retracted ones recompute from their prompts) and the KV pool's pages are given
  back with ``MADV_DONTNEED`` (:meth:`~radixserve.memory.pool.KVPool.release_memory`). The
  pool then reads as zeros, as when it was made, and faults in again as it is written, so
  resuming reallocates nothing: it only lets requests run again (a serving worker holds
  them meanwhile). Weights may be updated while it is released.
* ``weights``: the model's weight memory is given back
  (:mod:`~radixserve.model.weight_release`); its contents are undefined from then on, as
  SGLang's without a CPU backup and vLLM's after ``sleep(level=2)`` are. Resuming only
  makes the model whole again: load the weights with ``update_weights_from_disk`` before
  generating (refused while they are released). vLLM's level 1 keeps them: on the CPU they
  are host memory already, which its offload would only copy.

Both only while no request holds KV (nothing running; waiting and retracted requests may
stay): pause with mode ``retract`` or ``abort`` first. The CPU engine's tensors only (a GPU's
memory is not private anonymous memory ``madvise`` can drop), and one process's: with
tensor or pipeline parallelism the other ranks' memory would stay, and with prefill/decode
disaggregation a peer may be reading this pool, so both are refused. A speculative draft
model's weights and KV, and the hierarchical cache's host and disk tiers, keep their memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from radixserve.engine.memory_tags import MEMORY_TAGS
from radixserve.model.weight_release import ReleasedWeights, release_weights

log = logging.getLogger(__name__)

HOLDS_KV = "requests are running: pause with mode 'retract' or 'abort' first"


def memory_tags(tags: Iterable[str] | None) -> list[str]:
    """``tags`` checked, in :data:`MEMORY_TAGS`' order (None: all); ``ValueError`` naming
    the known ones for any other."""
    if tags is None:
        return list(MEMORY_TAGS)
    asked = set(tags)
    unknown = sorted(asked - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}: the tags are {list(MEMORY_TAGS)}")
    return [t for t in MEMORY_TAGS if t in asked]


class MemoryOccupation:
    """Which parts of ``engine``'s memory are released (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._weights: ReleasedWeights | None = None
        self._kv_released = False

    @property
    def released(self) -> list[str]:
        """The tags released now, in :data:`MEMORY_TAGS`' order."""
        flags = {"kv_cache": self._kv_released, "weights": self._weights is not None}
        return [t for t in MEMORY_TAGS if flags[t]]

    def release(self, tags: Iterable[str] | None) -> int:
        """Release ``tags`` (None: all; those released already stay so); the bytes given
        back. ``ValueError``, with nothing released, where the engine cannot."""
        asked = memory_tags(tags)
        refused = self._refusal()
        if refused is not None:
            raise ValueError(refused)
        freed = 0
        engine = self._engine
        if "kv_cache" in asked and not self._kv_released:
            flushed = engine.scheduler.flush_cache(waiting_ok=True)
            assert flushed, "with nothing running the cache flushes"
            freed += engine.pool.release_memory()
            self._kv_released = True
        if "weights" in asked and self._weights is None:
            self._weights = release_weights(engine.model)
            freed += self._weights.freed
        log.info("memory released (%s): %.0f MiB", ", ".join(asked), freed / 2**20)
        return freed

    def resume(self, tags: Iterable[str] | None) -> None:
        """Take ``tags`` again (None: all): the KV pool is usable at once; the weights are
        whole but undefined until ``update_weights_from_disk``."""
        asked = memory_tags(tags)
        if "weights" in asked and self._weights is not None:
            self._weights.restore()
            self._weights = None
        if "kv_cache" in asked:
            self._kv_released = False
        log.info("memory resumed (%s)", ", ".join(asked))

    def step_refusal(self) -> str | None:
        """Why no step may run now (the weights are released), or None."""
        if self._weights is None:
            return None
        return "the weights are released: resume them and update_weights_from_disk first"

    def _refusal(self) -> str | None:
        engine = self._engine
        if engine.disagg is not None:
            return "memory cannot be released with prefill/decode disaggregation"
        if engine.topology.parallel:
            return (
                "memory cannot be released with tensor or pipeline parallelism "
                "(only this rank's would be)"
            )
        if engine.device.type != "cpu":
            return f"memory is released on the CPU engine only, not on {engine.device.type}"
        if engine.has_running():
            return HOLDS_KV
        return None
