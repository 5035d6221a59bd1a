"""The KV references running requests hold, and when they are given back.

A running request holds (see :mod:`~radixserve.scheduling.request` for the map)::

    one lock        on ``lock_node``, protecting its first ``cached_len`` tokens' tree pages
    private pages   ``pages[cached_len // page_size:]``, its own until they join the tree
    one row         of the device page table (``slot``)

:class:`KVReferences` moves computed pages into the tree as they are computed, and gives
everything back when a request leaves the running set (finish, abort, error, retraction).
It also counts launched and resolved steps: while a launched step is not resolved
(overlap scheduling) it may still read the pages a request gives up, so those releases
wait in :class:`~radixserve.scheduling.deferred.DeferredReleases` until that step is
resolved.
"""

from __future__ import annotations

from radixserve.memory import PageAllocator, PrefixCache
from radixserve.memory.window_pool import WindowedPageAllocator, WindowPages, first_window_page
from radixserve.scheduling.deferred import DeferredReleases
from radixserve.scheduling.plan import PageTableRows
from radixserve.scheduling.request import Request

__all__ = ["KVReferences"]


class KVReferences:
    """Tree locks, private pages and page-table rows of running requests; steps in flight."""

    def __init__(
        self, cache: PrefixCache, allocator: PageAllocator, rows: PageTableRows, page_size: int
    ) -> None:
        self.cache = cache
        self.allocator = allocator
        self.rows = rows
        self.page_size = page_size
        self._launched = 0  # steps advanced (launched) so far
        self._resolved = 0  # steps resolved so far; a step is in flight while _resolved < _launched
        self._deferred = DeferredReleases(allocator, cache)  # given up while a step was in flight
        # A sliding-window model's window pool (memory.window_pool), None otherwise.
        self.window: WindowPages | None = (
            allocator.window if isinstance(allocator, WindowedPageAllocator) else None
        )

    @property
    def in_flight(self) -> bool:
        """Whether a launched step is not resolved yet."""
        return self._resolved < self._launched

    def step_launched(self) -> None:
        """The runner launched a step: pages given up from now on may be read by it."""
        self._launched += 1

    def step_resolved(self) -> None:
        """The oldest step in flight was resolved (its deferred releases: :meth:`free_deferred`)."""
        self._resolved += 1

    def free_deferred(self) -> None:
        """Release what waited for a step that is now resolved."""
        if self.window is not None:  # first: a global page freed below frees its window page
            self.window.free_deferred(self._resolved)
        self._deferred.release(self._resolved)

    def release_window(self, req: Request) -> None:
        """A window pool: give back the window pages of ``req``'s private pages that end
        before its next row's window (their global pages stay; tree pages are unreferenced
        when its lock moves on, by the cache)."""
        w = self.window
        if w is None:
            return
        lo = max(req.cached_len // self.page_size, req.window_lo)
        hi = first_window_page(req.computed_len, w.window, self.page_size)
        if hi > lo:
            w.release_private(req.pages[lo:hi], self._launched if self.in_flight else None)
            req.window_lo = hi

    def free_pages(self, pages: list[int]) -> None:
        """Give pages back now, or, while a step is in flight (it may read them), once it is resolved."""
        if not pages:
            return
        if self.in_flight:
            self._deferred.add(self._launched, pages)
        else:
            self.allocator.free(pages)

    def cache_computed(self, req: Request) -> None:
        """Insert the request's computed whole pages into the tree; re-point its lock."""
        assert req.lock_node is not None, f"a running request holds a lock: {req}"
        res = self.cache.cache_prefix(
            req.token_ids[: req.computed_len],
            req.pages,
            req.lock_node,
            req.namespace,
            release=self.free_pages,
        )
        if res.pages != req.pages:
            self.rows.set_row(req.slot, res.pages)
        req.pages, req.lock_node, req.cached_len = res.pages, res.node, res.cached_len

    def release(self, req: Request) -> None:
        """Give back every reference running ``req`` holds: cache its KV, unlock, free its
        private pages, give its row back. (The caller takes it out of the running set.)"""
        self.cache_computed(req)
        private = req.pages[req.cached_len // self.page_size :]
        if self.in_flight:
            # The step in flight may read these pages (the tree's ones too): keep them locked
            # and allocated until it is resolved.
            self._deferred.add(self._launched, private, req.lock_node)
        else:
            assert req.lock_node is not None  # just re-pointed by cache_computed
            self.cache.unlock(req.lock_node)
            self.allocator.free(private)
        self.rows.release(req.slot)
        req.pages, req.lock_node, req.slot = [], None, -1
        req.cached_len = req.computed_len = req.window_lo = 0
        req.finishing = False

    def private_pages(self, running: list[Request]) -> list[int]:
        """Pages ``running`` requests hold outside the tree, and pages waiting for a step in flight."""
        ps = self.page_size
        return [p for r in running for p in r.pages[r.cached_len // ps :]] + self._deferred.pages()
