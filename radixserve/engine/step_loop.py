"""The step loop: schedule, execute, process; plain or overlapped.

Plain (the CPU's default)::

    batch = scheduler.schedule(); result = runner.execute(batch.plan); scheduler.process(batch, result)

Overlapped (SGLang's overlap loop, the CUDA default): step N+1 is planned and launched before
step N's results are read, so the host's scheduling and output handling run while the
device computes::

    schedule(N+1) -> runner.launch(N+1) -> scheduler.advance(N+1) -> resolve(N) [waits for N]

A step whose requests need their last token on the host to plan the next one (grammar
masks, penalties), or a schedule that would have to retract (:class:`NeedsSync`), resolves
the step in flight first. See :mod:`radixserve.scheduling.scheduler` for what ``advance``
and ``resolve`` do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixserve.engine.model_runner import ModelRunner, PendingStep
from radixserve.scheduling.plan import ScheduledBatch, StepResult
from radixserve.scheduling.scheduler import NeedsSync, RequestOutput, Scheduler, StepFailure

logger = logging.getLogger(__name__)

__all__ = ["StepLoop"]


class StepLoop:
    """Drives one scheduler and one runner, one :meth:`step` at a time."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        overlap: bool,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """``on_error``: called with a failed step's exception once its requests have been
        failed and their pages given back; it may raise to stop the engine (a tensor-parallel
        rank failed: the ranks are out of step, no later step can run)."""
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self.on_error = on_error
        self._in_flight: tuple[ScheduledBatch, PendingStep] | None = None  # launched, not resolved

    @property
    def in_flight(self) -> bool:
        """Whether a launched step's results are still to be read (overlap)."""
        return self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """One step; the outputs of every request that progressed (with overlap: those of the
        step before, whose results were read during this one)."""
        if self.overlap:
            return self._step_overlap()
        sched = self.scheduler
        outputs = sched.take_outputs()
        batch = sched.schedule()
        if batch is None:
            return outputs
        try:
            result = self.runner.execute(batch.plan)
        except (
            Exception
        ) as e:  # a failed step (device memory, a device error) must not leak its pages
            logger.exception("step failed; finishing %d requests with an error", len(batch.work))
            outputs += sched.fail(batch, e)
            self._failed(e)
            return outputs
        sched.advance(batch)
        return outputs + self._resolve(batch, result)

    def _failed(self, e: Exception) -> None:
        if self.on_error is None:
            return
        # on_error stops the engine (the ranks are out of step): a step launched after the
        # failed one will never be read, so its requests end now, their pages back.
        if self._in_flight is not None:
            batch, _ = self._in_flight
            self._in_flight = None
            self.scheduler.fail(batch, e, advanced=True)
        self.on_error(e)

    def _resolve(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """``batch``'s results through the scheduler. A :class:`StepFailure` raised meanwhile
        (a finish hook's KV transfer lost a tensor-parallel rank) fails the batch as a failed
        forward does: its requests end with the error, their pages back, then ``on_error``."""
        try:
            return self.scheduler.resolve(batch, result)
        except StepFailure as e:
            logger.exception("step failed; finishing %d requests with an error", len(batch.work))
            outputs = self.scheduler.fail(batch, e)  # resolve() already marked it resolved
            self._failed(e)
            return outputs

    def _step_overlap(self) -> list[RequestOutput]:
        """Plan and launch step N+1, then read step N's results (SGLang's overlap loop)::

        schedule(N+1) -> launch(N+1) -> advance(N+1) -> resolve(N) [waits for N] -> return
        """
        sched = self.scheduler
        outputs = sched.take_outputs()
        if self._in_flight is not None and self._in_flight[0].needs_results():
            outputs += self._resolve_in_flight()  # grammar masks / penalties need N's tokens
        try:
            batch = sched.schedule()
        except NeedsSync:  # it would retract: resolve N first, then decide with everything known
            outputs += self._resolve_in_flight()
            batch = sched.schedule()
        if batch is None:
            return outputs + self._resolve_in_flight()
        try:
            pending = self.runner.launch(batch.plan)
        except Exception as e:
            logger.exception("step failed; finishing %d requests with an error", len(batch.work))
            outputs += self._resolve_in_flight()
            outputs += sched.fail(batch, e)
            self._failed(e)
            return outputs
        sched.advance(batch)
        # N+1 is in flight before N is read: should reading N stop the engine (_failed), N+1's
        # requests are failed too.
        prev, self._in_flight = self._in_flight, (batch, pending)
        return outputs + self._read(prev)

    def settle(self) -> list[RequestOutput]:
        """Read the step in flight, if any (nothing new is launched): its outputs. Afterwards
        the scheduler may change the running set outside a step (a pause's retraction)."""
        return self._resolve_in_flight()

    def _resolve_in_flight(self) -> list[RequestOutput]:
        entry, self._in_flight = self._in_flight, None
        return self._read(entry)

    def _read(self, entry: tuple[ScheduledBatch, PendingStep] | None) -> list[RequestOutput]:
        """Wait for a launched step's results and take them; a failed step fails its requests."""
        if entry is None:
            return []
        batch, pending = entry
        try:
            result = pending.result()
        except Exception as e:
            logger.exception("step failed; finishing %d requests with an error", len(batch.work))
            outputs = self.scheduler.fail(batch, e, advanced=True)
            self._failed(e)
            return outputs
        return self._resolve(batch, result)
