"""The prefix-cache interface: what the scheduler, the engine and pinning ask of a cache.

Three caches implement it: :class:`~radixserve.memory.radix_cache.RadixCache` (the radix
tree over the pool's pages), :class:`~radixserve.memory.hi_radix_cache.HiRadixCache` (the
same tree with host-memory and disk tiers below it) and
:class:`~radixserve.memory.no_cache.NoPrefixCache` (``disable_radix_cache``: the answers
of a cache that is always empty, so callers never ask "is the cache on?").

A request's life against it::

    match_prefix(tokens) -> MatchResult(pages, matched_len, node)   longest cached page-aligned prefix
    lock(node)                                                       the matched path cannot be evicted
    ... allocate the rest, prefill, decode ...
    cache_prefix(tokens, pages, node) -> CachedPrefix                finished whole pages join the tree;
                                                                     the lock moves to the new node
    unlock(node)                                                     on every way a request ends

Page accounting (checked by :meth:`PrefixCache.check_invariants`): every page of the
allocator is free, cached and evictable (no reference), or in use (on a locked path, or
private to one request).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from radixserve.memory.tree_node import CachedPrefix, CacheStats, MatchResult, TreeNode

if TYPE_CHECKING:
    from radixserve.memory.allocator import PageAllocator
    from radixserve.memory.eviction.control import EvictionControl
    from radixserve.memory.kv_events import KVEventRecorder
    from radixserve.memory.leases import LeaseTable
    from radixserve.memory.miss_report import MissLog
    from radixserve.memory.pins import PinTable

__all__ = ["PrefixCache"]


class PrefixCache(ABC):
    """A cache of token prefixes over the KV pages of one pool (see the module docstring)."""

    #: False for a cache that never reuses a prefix: waiting for another request to compute
    #: a shared prefix would gain nothing (the scheduler reads it).
    reuses_prefixes: bool
    allocator: PageAllocator
    page_size: int
    #: Prefixes held against eviction (``/pin``); the engine sets the page budget.
    pins: PinTable
    #: Sessions' leased paths, kept through their pauses (``memory.leases``).
    leases: LeaseTable
    #: The eviction policy and its regret accounting (``memory.eviction``).
    eviction: EvictionControl
    #: Where KV cache events go, when the engine records them.
    listener: KVEventRecorder | None
    #: Eviction records and miss reports (``memory.miss_report``); None: a cache that
    #: caches nothing (every miss is the same: no cache).
    misses: MissLog | None

    # ---------------------------------------------------------------- gauges
    @property
    @abstractmethod
    def num_cached_pages(self) -> int:
        """Pages the cache holds (evictable + protected)."""

    @property
    @abstractmethod
    def num_leased_pages(self) -> int:
        """Cached pages on some session's leased path (evicted only after every unleased one)."""

    @property
    @abstractmethod
    def num_evictable_pages(self) -> int:
        """Cached pages no running request references: freeable by :meth:`evict`."""

    @property
    @abstractmethod
    def num_protected_pages(self) -> int:
        """Cached pages on some locked path (in use)."""

    @property
    @abstractmethod
    def total_cached_tokens(self) -> int:
        """Tokens the cached pages hold."""

    @property
    @abstractmethod
    def stats(self) -> CacheStats:
        """Queried, hit, evicted and inserted token counts since start."""

    # ---------------------------------------------------------------- a request's life
    @abstractmethod
    def match_prefix(
        self, tokens: Sequence[int], namespace: Hashable | None = None, record_stats: bool = True
    ) -> MatchResult:
        """Longest cached prefix of ``tokens`` in ``namespace``, rounded down to whole pages.
        May refresh access times and split an edge; does not lock (call :meth:`lock`)."""

    @abstractmethod
    def take_loaded(self, node: TreeNode) -> tuple[int, int]:
        """Pages on the path root..``node`` that a lower tier (L2, L3) loaded and no request
        used since, as (L2, L3); they count as used from now on (usage by tier)."""

    @abstractmethod
    def record_lookup(self, queried: int, hit: int) -> None:
        """Count one look-up of ``queried`` tokens of which ``hit`` were cached."""

    @abstractmethod
    def peek_prefix_len(self, tokens: Sequence[int], namespace: Hashable | None = None) -> int:
        """Length of the cached page-aligned prefix of ``tokens``, without touching anything."""

    @abstractmethod
    def lock(self, node: TreeNode) -> None:
        """Take one reference on the path to ``node``: none of it is evicted until :meth:`unlock`."""

    @abstractmethod
    def unlock(self, node: TreeNode) -> None:
        """Drop one reference taken by :meth:`lock` (or handed over by :meth:`cache_prefix`)."""

    @abstractmethod
    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: Hashable | None = None
    ) -> int:
        """Offer the whole pages of ``tokens``; returns how many leading tokens were cached
        already (the caller frees its duplicate pages for them)."""

    @abstractmethod
    def cache_prefix(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        node: TreeNode,
        namespace: Hashable | None = None,
        release: Callable[[list[int]], None] | None = None,
    ) -> CachedPrefix:
        """Move a request's finished whole pages into the cache and re-point its lock."""

    # ---------------------------------------------------------------- memory
    @abstractmethod
    def evict(self, n_pages: int) -> int:
        """Free up to ``n_pages`` unreferenced pages, least recently used first; returns how many."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached prefix and free its pages (no locks may be held)."""

    @abstractmethod
    def check_invariants(self, private_pages: Iterable[int] = ()) -> None:
        """Verify the page accounting; ``private_pages``: every page requests hold outside
        the cache. Raises ``AssertionError`` naming the first broken invariant."""
