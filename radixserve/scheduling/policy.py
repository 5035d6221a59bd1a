"""Which waiting request to admit first.

- FCFS: arrival order (a retracted request keeps its arrival, so it goes back to the front).
- LPM (longest prefix match): the requests whose prompt the radix cache already holds the
  most of go first, so hot prefixes are used while they are resident and evicted less.
  LPM's known failure is starvation: a cold request can wait forever behind a stream of
  hot ones (a long TTFT tail). The aging bound fixes that: a request that later arrivals
  have overtaken ``max_bypass`` times jumps ahead of the LPM order (oldest first), so no
  request waits behind more than ``max_bypass`` younger ones. With a very long queue the
  per-step matching costs more than it saves, so LPM falls back to FCFS above ``max_queue``
  waiting requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from radixserve.scheduling.request import Request
from radixserve.scheduling.types import SchedulerConfig


class SchedulePolicy(ABC):
    """Orders the waiting queue before admission."""

    @abstractmethod
    def order(self, waiting: Sequence[Request], step: int) -> list[Request]:
        """Return ``waiting`` in admission order (a new list)."""


class FCFSPolicy(SchedulePolicy):
    """First come, first served."""

    def order(self, waiting: Sequence[Request], step: int) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival_step)


class LPMPolicy(SchedulePolicy):
    """Longest cached prefix first, with an aging bound against starvation."""

    def __init__(
        self,
        cache: Any,
        max_bypass: int = SchedulerConfig.lpm_max_bypass,
        max_queue: int = SchedulerConfig.lpm_max_queue,
    ) -> None:
        self.cache = cache
        self.max_bypass = max_bypass
        self.max_queue = max_queue

    def order(self, waiting: Sequence[Request], step: int) -> list[Request]:
        if len(waiting) > self.max_queue or len(waiting) <= 1:
            return sorted(waiting, key=lambda r: r.arrival_step)
        aged: list[Request] = []
        scored: list[tuple[int, int, Request]] = []
        for r in waiting:
            if r.bypassed >= self.max_bypass:
                aged.append(r)
                continue
            # peek: scoring must not split edges, refresh LRU times or count as cache queries.
            matched = self.cache.peek_prefix_len(r.token_ids[: r.match_limit], r.namespace)
            scored.append((-matched, r.arrival_step, r))
        aged.sort(key=lambda r: r.arrival_step)
        scored.sort(key=lambda t: (t[0], t[1]))
        return aged + [r for _, _, r in scored]


def make_policy(
    name: str,
    cache: Any,
    max_bypass: int = SchedulerConfig.lpm_max_bypass,
    max_queue: int = SchedulerConfig.lpm_max_queue,
) -> SchedulePolicy:
    """``"lpm"`` or ``"fcfs"``."""
    if name == "lpm":
        return LPMPolicy(cache, max_bypass, max_queue)
    if name == "fcfs":
        return FCFSPolicy()
    raise ValueError(f"unknown schedule policy {name!r}; expected 'lpm' or 'fcfs'")


def count_bypasses(waiting: Sequence[Request], admitted: Sequence[Request]) -> None:
    """Record, for each request still waiting, how many later arrivals were just admitted
    ahead of it (the aging bound's count, :attr:`Request.bypassed`)."""
    if not admitted:
        return
    newest_admitted = max(r.arrival_step for r in admitted)
    for r in waiting:
        if r.arrival_step < newest_admitted:
            r.bypassed += sum(1 for a in admitted if a.arrival_step > r.arrival_step)
