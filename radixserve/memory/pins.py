"""Pinned prefixes with a time-to-live, within a page budget (SGLang-style pin, refreshed on hit).

A pin is one extra lock on the node that ends the pinned prefix, held by this table instead
of a request: while it holds, nothing on the path can be evicted from L1. Every match that
passes through a pinned node pushes its expiry to ``now + ttl`` again (refresh on hit; a match
covering only part of the pinned prefix does not refresh it), so a prefix in steady use
stays pinned. When a pin expires its lock is dropped: the prefix becomes
ordinary cached KV, and with lower tiers its pages are copied to L2 at once (demoted, not
dropped; they leave L1 later by LRU like any other page).

The budget counts the pages on pinned paths (a page under two pins counts twice: the
bound is conservative), so pins can never take more than ``budget_pages`` of L1 away from
running requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

from radixserve.memory.interfaces import PinnableCache
from radixserve.memory.tree_node import TreeNode


class PinTable:
    """The pins of one cache. ``clock`` (seconds, monotonic) is injectable for tests."""

    def __init__(
        self, cache: PinnableCache, budget_pages: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if budget_pages < 0:
            raise ValueError(f"pin budget must be >= 0 pages, got {budget_pages}")
        self.cache = cache
        self.budget_pages = budget_pages
        self.clock = clock
        self._pins: dict[TreeNode, tuple[float, float]] = {}  # node -> (expiry, ttl)
        self._pages = 0
        self.refused = 0

    @property
    def pinned_pages(self) -> int:
        """Pages on pinned paths (the budget's measure)."""
        return self._pages

    def __len__(self) -> int:
        return len(self._pins)

    def expiry(self, node: TreeNode) -> float | None:
        entry = self._pins.get(node)
        return None if entry is None else entry[0]

    def pin(self, tokens: Sequence[int], namespace: Hashable | None, ttl_s: float) -> int:
        """Pin the cached page-aligned prefix of ``tokens`` for ``ttl_s`` seconds (an existing
        pin on it is extended). Returns the tokens pinned: 0 when nothing of it is cached or
        the budget is exhausted."""
        if ttl_s <= 0 or not self.cache.reuses_prefixes:
            return 0
        m = self.cache.match_prefix(tokens, namespace, record_stats=False)
        node = m.node
        if node.parent is None:
            return 0
        now = self.clock()
        old = self._pins.get(node)
        if old is not None:
            self._pins[node] = (max(old[0], now + ttl_s), max(old[1], ttl_s))
            return node.depth
        pages = node.depth // self.cache.page_size
        if self._pages + pages > self.budget_pages:
            self.refused += 1
            return 0
        self.cache.lock(node)
        self._pins[node] = (now + ttl_s, ttl_s)
        self._pages += pages
        return node.depth

    def touch(self, node: TreeNode) -> None:
        """A match ended at ``node``: refresh every pin on its path (O(depth in nodes))."""
        if not self._pins:
            return
        now = self.clock()
        n: TreeNode | None = node
        while n is not None and n.parent is not None:
            entry = self._pins.get(n)
            if entry is not None:
                self._pins[n] = (max(entry[0], now + entry[1]), entry[1])
            n = n.parent

    def expire(self, now: float | None = None) -> int:
        """Drop the pins whose time is up (their pages stay cached; with lower tiers they are
        copied to L2 now). Returns how many expired."""
        if not self._pins:
            return 0
        now = self.clock() if now is None else now
        done = [n for n, (expiry, _) in self._pins.items() if expiry <= now]
        for node in done:
            self._drop(node)
            back_up = getattr(self.cache, "back_up", None)  # a tiered cache copies the prefix to L2
            if back_up is not None:
                back_up(node)
        return len(done)

    def clear(self) -> None:
        """Drop every pin (a cache reset)."""
        for node in list(self._pins):
            self._drop(node)

    def _drop(self, node: TreeNode) -> None:
        del self._pins[node]
        self._pages -= node.depth // self.cache.page_size
        self.cache.unlock(node)

    def check_invariants(self) -> None:
        pages = 0
        for node in self._pins:
            if not node.alive or node.holders < 1:
                raise AssertionError(
                    f"pin invariant broken: pinned node evicted or not locked: {node!r}"
                )
            pages += node.depth // self.cache.page_size
        if pages != self._pages or pages > self.budget_pages:
            raise AssertionError(
                f"pin invariant broken: {self._pages} pages counted, {pages} pinned, budget {self.budget_pages}"
            )
