"""A worker's pause (SGLang's ``pause_generation`` / ``continue_generation``, vLLM's
``/pause`` / ``/resume``): what an RL loop does around a weight update, so that no rollout
mixes two policies it did not mean to.

A pause holds every request that comes until the continue (worker/held.py), and does one
of four things with the requests the engine has (:data:`~radixserve.serving.wire.protocol.PauseMode`):

* ``abort``: ends them, and the held ones, as aborted (the router settles each);
* ``retract``: sends the running ones back to the queue, their KV so far cached in the
  tree and nothing locked (``Engine.retract_running``); they are recomputed when they run
  again, with the weights served then;
* ``in_place``: keeps them, KV and all; no step runs until the continue;
* ``wait``: lets them finish, then answers.

The step in flight is read first (``Engine.settle``), so every token computed is reported.
While paused (but in ``wait``) the worker runs no step; outputs that need none (an abort's)
still go out (``Engine.take_outputs``). A weight update applies at once while no request
holds KV (abort, retract, wait once drained) and is refused while requests are kept in
place with KV of the weights served (SGLang refuses its cache flush then too).
``clear_cache`` drops the cached prefixes once nothing runs (``abort``, ``wait``; ignored
for requests kept or retracted, whose weight update drops them anyway).

Paused with prefill/decode disaggregation is refused: a KV transfer in progress has peers
on other workers that a pause here would leave waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from radixserve.serving.wire import protocol as p
from radixserve.serving.worker.held import HeldRequests

log = logging.getLogger("radixserve.serving.worker")

IN_PLACE_HOLDS_KV = (
    "requests are paused in place with KV of the weights served: pause with mode "
    "'retract' or 'abort' before updating the weights"
)


class Pausing:
    """One worker's pause state (see the module docstring). ``abort_all``: ends every
    request the worker has, held ones included, as aborted; returns how many ran."""

    HOLDER = "pause"

    def __init__(
        self,
        engine: Any,
        send: Callable[[msgspec.Struct], None],
        held: HeldRequests,
        abort_all: Callable[[], int],
        disaggregated: bool = False,
    ) -> None:
        self._engine, self._send, self._held = engine, send, held
        self._abort_all, self._disaggregated = abort_all, disaggregated
        self.mode: p.PauseMode | None = None
        self._draining: list[p.WorkerPause] = []  # "wait" pauses answered once nothing runs

    @property
    def stepping(self) -> bool:
        """Whether the engine may run steps (not paused, or paused to let requests finish)."""
        return self.mode is None or self.mode == "wait"

    def weights_ready(self) -> bool:
        """Whether a weight update may apply now: nothing runs or waits, or paused with
        nothing holding KV (the queue runs with the new weights after the continue)."""
        if not self._engine.has_unfinished():
            return True
        return not self.stepping and not self._holds_kv()

    def weights_refusal(self) -> str | None:
        """Why a weight update that comes now is refused (requests kept in place), or None."""
        return IN_PLACE_HOLDS_KV if self.mode == "in_place" and self._holds_kv() else None

    def pause(self, msg: p.WorkerPause) -> None:
        """Pause, or change a pause's mode (a pause in place, then retracted)."""
        refused = self._refusal(msg)
        if refused is not None:
            self._reply(msg.token, refused)
            return
        self._held.hold_for(self.HOLDER)
        settle = getattr(self._engine, "settle", None)
        if settle is not None:
            settle()
        stopped = 0
        if msg.mode == "abort":
            stopped = self._abort_all()
        elif msg.mode == "retract":
            stopped = self._engine.retract_running()
        self.mode = msg.mode
        log.info("paused (%s), %d running requests stopped", msg.mode, stopped)
        if msg.mode == "wait":
            self._draining.append(msg)
            self.poll()
            return
        self._reply(msg.token, self._clear(msg), stopped)

    def _refusal(self, msg: p.WorkerPause) -> str | None:
        if self._disaggregated:
            return "pausing is not supported with prefill/decode disaggregation"
        if msg.mode == "retract" and not hasattr(self._engine, "retract_running"):
            return "this worker's engine cannot retract its requests"
        return None

    def resume(self, msg: p.WorkerContinue) -> None:
        """Generate again: the kept requests step, the held ones start."""
        for waiting in self._draining:  # continued before its requests finished
            self._reply(waiting.token, "continued before the running requests finished")
        self._draining = []
        self.mode = None
        self._held.release(self.HOLDER)
        log.info("generating again")
        self._reply(msg.token, None, paused=False)

    def poll(self) -> None:
        """Between steps: answer the ``wait`` pauses once nothing runs or waits."""
        if not self._draining or self._engine.has_unfinished():
            return
        for msg in self._draining:
            self._reply(msg.token, self._clear(msg))
        self._draining = []

    def flush(self) -> bool:
        """``/flush_cache``: where nothing runs or waits, and while paused with nothing
        holding KV even with retracted requests waiting (they are then recomputed from their
        prompts, as SGLang's retract mode allows)."""
        retracts = hasattr(self._engine, "retract_running")  # the real engine: waiting_ok
        if retracts and self.mode in ("retract", "abort") and not self._holds_kv():
            return bool(self._engine.flush_cache(waiting_ok=True))
        return bool(self._engine.flush_cache())

    def _clear(self, msg: p.WorkerPause) -> str | None:
        """The pause's ``clear_cache`` (with ``abort`` and ``wait``, which leave the engine
        idle; vLLM ignores it for requests kept): why it failed, or None."""
        if not msg.clear_cache or msg.mode in ("in_place", "retract"):
            return None
        return None if self._engine.flush_cache() else "the cache was not cleared"

    def _holds_kv(self) -> bool:
        has_running = getattr(self._engine, "has_running", self._engine.has_unfinished)
        return bool(has_running())

    def _reply(
        self, token: int, error: str | None, stopped: int = 0, paused: bool | None = None
    ) -> None:
        now = self.mode is not None if paused is None else paused
        self._send(p.WorkerPauseReply(token=token, error=error, paused=now, stopped=stopped))
