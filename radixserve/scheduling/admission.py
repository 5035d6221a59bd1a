"""Admission of waiting requests into one step: budget, reserved pages, prefills in flight.

One :class:`PrefillAdder` lives for one step's admission (SGLang's ``PrefillAdder`` is the
shape). It starts from what the running requests already took (token budget, pages they
are expected to need) and, for each waiting request in policy order, decides::

    defer     another request is computing this one's next uncached pages right now:
              skip it this step (it will find them cached), keep looking
    admit     match the prompt in the cache, lock the hit, allocate the first chunk's pages,
              take a page-table row
    stop      out of token budget, request slots, or KV headroom: admit no one else

Memory headroom follows SGLang: each running request reserves pages for ``new_token_ratio``
of its remaining ``max_tokens`` (:meth:`NewTokenRatio.expected_len`); a request is admitted
only if, on top of the pages already reserved, its own expected pages fit in free +
evictable pages (an idle engine admits anything whose first chunk fits).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from radixserve.memory import PageAllocator, PrefixCache
from radixserve.memory.allocator import OutOfPagesError
from radixserve.scheduling.plan import PageTableRows
from radixserve.scheduling.request import Request, RequestStatus
from radixserve.scheduling.types import SchedulerConfig


class NewTokenRatio:
    """The fraction of its remaining ``max_tokens`` a running request is expected to still
    produce (SGLang's ``new_token_ratio``). It decays every step nothing is retracted and
    jumps back up when something is, so admission tracks how long outputs really are."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.value = config.init_new_token_ratio

    def decay(self) -> None:
        """A step planned without retracting anything."""
        self.value = max(
            self.config.min_new_token_ratio, self.value - self.config.new_token_ratio_decay
        )

    def bump(self) -> None:
        """A request was retracted: admission was too optimistic."""
        self.value = min(1.0, self.value + 0.2)

    def expected_len(self, r: Request) -> int:
        """Tokens ``r`` is expected to hold at its end: what it has, plus its remaining output
        (``max_tokens`` less what it already produced, capped) scaled by the ratio, and never
        past the context it may reach (``max_total_len``)."""
        remaining_out = min(r.params.max_tokens - r.num_output, self.config.reserve_tokens_cap)
        future = int(max(0, remaining_out) * self.value)
        return min(len(r.token_ids) + future, max(r.max_total_len, len(r.token_ids)))


class AddResult(enum.Enum):
    ADDED = "added"
    DEFERRED = "deferred"  # passed over this step; later requests may still be admitted
    STOP = "stop"  # nothing more fits this step


class PrefillAdder:
    """Admits waiting requests for one step while its budget, slots and KV headroom last."""

    def __init__(
        self,
        *,
        cache: PrefixCache,
        allocator: PageAllocator,
        rows: PageTableRows,
        page_size: int,
        token_budget: int,
        free_slots: int,
        running: list[Request],
        inflight: list[Request],
        expected_len: Callable[[Request], int],
        defer_tokens: int,
    ) -> None:
        self.cache = cache
        self.allocator = allocator
        self.rows = rows
        self.page_size = page_size
        self.budget = token_budget
        self.free_slots = free_slots
        self.idle = not running
        self.expected_len = expected_len
        # Pages the running requests may still need beyond those they hold.
        self.reserved = sum(self._pages_beyond(r) for r in running)
        # Requests computing uncached tokens now (or in coming steps): others may wait for them.
        self.inflight = inflight
        self.defer_tokens = defer_tokens if cache.reuses_prefixes else 0
        self.admitted: list[tuple[Request, int]] = []

    def _pages_beyond(self, r: Request) -> int:
        return max(0, -(-self.expected_len(r) // self.page_size) - len(r.pages))

    def add(self, req: Request) -> AddResult:
        """Try to admit ``req``; on success it is RUNNING with its pages, lock and row."""
        if self.budget <= 0 or self.free_slots <= 0:
            return AddResult.STOP
        ps = self.page_size
        tokens = req.token_ids[: req.match_limit]
        # Deciding to defer only peeks: a request passed over must not touch the tree.
        if self.defer_tokens and self._should_defer(
            req, self.cache.peek_prefix_len(tokens, req.namespace)
        ):
            return AddResult.DEFERRED
        # The cache's hit counters count admissions, not every step a request waits.
        match = self.cache.match_prefix(tokens, req.namespace, record_stats=False)
        m = match.matched_len
        n = min(len(req.token_ids) - m, self.budget)
        self.cache.lock(match.node)  # before allocating: allocation may evict
        need_now = -(-(m + n) // ps) - len(match.pages)
        need_all = -(-self.expected_len(req) // ps) - len(match.pages)
        available = self.allocator.num_free + self.cache.num_evictable_pages
        if need_now > available or (not self.idle and need_all + self.reserved > available):
            self.cache.unlock(match.node)
            return AddResult.STOP
        try:
            new_pages = self.allocator.alloc(need_now)
        except OutOfPagesError:
            self.cache.unlock(match.node)
            return AddResult.STOP
        self.reserved += max(0, need_all - need_now)
        self.cache.record_lookup(len(tokens), m)
        req.status = RequestStatus.RUNNING
        req.lock_node = match.node
        req.pages = match.pages + new_pages
        req.cached_len = req.computed_len = m
        if req.cached_tokens is None:  # usage counts the first admission only
            req.loaded_pages, req.page_size_hint = self.cache.take_loaded(match.node), ps
        req.slot = self.rows.acquire()
        self.rows.set_row(req.slot, req.pages)
        self.admitted.append((req, n))
        self.inflight.append(req)
        self.budget -= n
        self.free_slots -= 1
        self.idle = False
        return AddResult.ADDED

    def _should_defer(self, req: Request, matched: int) -> bool:
        """Whether another request is computing at least the next few uncached tokens of ``req``."""
        want = matched + self.defer_tokens
        want += -want % self.page_size  # only whole pages become shareable
        if want > req.match_limit:
            return False
        key = req.token_ids[:want]
        for other in self.inflight:
            if (
                other.namespace == req.namespace
                and len(other.token_ids) > want
                and other.token_ids[:want] == key
            ):
                return True
        return False
