"""The prefix cache that caches nothing: the :class:`PrefixCache` interface, no reuse.

``disable_radix_cache`` builds this instead of a radix tree, so the scheduler never asks
"is the cache on?": it calls the same methods and gets the answers of a cache that is
always empty. Every page a request holds stays private to it; matches are empty; pages
handed to :meth:`insert` go back to the allocator; nothing is ever evictable.

Its one capability flag, :attr:`reuses_prefixes` (False), tells the scheduler that waiting
for another request to compute a shared prefix would gain nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from radixserve.memory.allocator import PageAllocator
from radixserve.memory.eviction.control import EvictionControl
from radixserve.memory.leases import LeaseTable
from radixserve.memory.pins import PinTable
from radixserve.memory.prefix_cache import PrefixCache
from radixserve.memory.tree_node import CachedPrefix, CacheStats, MatchResult, TreeNode

if TYPE_CHECKING:
    from radixserve.memory.kv_events import KVEventRecorder

__all__ = ["NoPrefixCache"]


class NoPrefixCache(PrefixCache):
    """A :class:`~radixserve.memory.prefix_cache.PrefixCache` that never holds a page."""

    reuses_prefixes = False

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._queried = self._hit = 0
        # Matches end at a root (no parent), which lock/unlock ignore, as RadixCache's do.
        self._root = TreeNode(0, (), [], None, 0, 0, None)
        allocator.set_evictor(None, lambda: 0)
        self.pins = PinTable(self, budget_pages=0)  # never holds a pin: nothing is cached
        self.leases = LeaseTable(None)  # nor a lease
        self.eviction = EvictionControl(None, 0, page_size)  # nor evicts
        self.listener: KVEventRecorder | None = None  # nothing to report either
        self.misses = None  # no miss to explain: nothing is ever cached

    # Gauges: nothing is ever cached.
    num_cached_pages = 0
    num_evictable_pages = 0
    num_protected_pages = 0

    @property
    def num_leased_pages(self) -> int:
        return 0  # nothing is cached, so nothing is leased

    total_cached_tokens = 0

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._queried, self._hit, 0, 0)

    def match_prefix(
        self, tokens: Sequence[int], namespace: Hashable | None = None, record_stats: bool = True
    ) -> MatchResult:
        """Always a miss, ending at the (inert) root."""
        if record_stats:
            self.record_lookup(len(tokens), 0)
        return MatchResult([], 0, self._root)

    def take_loaded(self, node: TreeNode) -> tuple[int, int]:
        return (0, 0)

    def record_lookup(self, queried: int, hit: int) -> None:
        self._queried += queried
        self._hit += hit

    def peek_prefix_len(self, tokens: Sequence[int], namespace: Hashable | None = None) -> int:
        return 0

    def lock(self, node: TreeNode) -> None:
        if node is not self._root:
            raise RuntimeError(f"lock() on a node this cache did not hand out: {node!r}")

    def unlock(self, node: TreeNode) -> None:
        if node is not self._root:
            raise RuntimeError(f"unlock() on a node this cache did not hand out: {node!r}")

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: Hashable | None = None
    ) -> int:
        """Free the whole pages the tree would have taken; nothing was cached before (returns 0)."""
        n_full = len(tokens) // self.page_size
        if len(pages) < n_full:
            raise ValueError(f"{len(tokens)} tokens need {n_full} whole pages, got {len(pages)}")
        self.allocator.free(pages[:n_full])
        return 0

    def cache_prefix(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        node: TreeNode,
        namespace: Hashable | None = None,
        release: Callable[[list[int]], None] | None = None,
    ) -> CachedPrefix:
        """Every page stays the request's own."""
        return CachedPrefix(node, list(pages), 0)

    def evict(self, n_pages: int) -> int:
        return 0

    def reset(self) -> None:
        """Nothing to drop."""

    def check_invariants(self, private_pages: Iterable[int] = ()) -> None:
        """Every page is free or private to exactly one request."""
        self.allocator.check_invariants()
        private = list(private_pages)
        free = self.allocator.free_pages()
        assert len(set(private)) == len(private), "a private page is held twice"
        assert free.isdisjoint(private), (
            f"pages both free and private: {sorted(free & set(private))[:8]}"
        )
        assert len(free) + len(private) == self.allocator.num_pages, (
            f"free {len(free)} + private {len(private)} != {self.allocator.num_pages} pages"
        )

    def __repr__(self) -> str:
        return f"NoPrefixCache(page_size={self.page_size}, free={self.allocator.num_free})"
