"""The hierarchical cache of a sliding-window model: L2 carries window KV where it is.

:class:`~radixserve.memory.hi_radix_cache.HiRadixCache`'s demotion and load-back over
:class:`~radixserve.memory.swa_cache.SWARadixCache`'s two pools. A page leaving L1 takes its
global layers' KV to L2 and its window layers' too while it still has a window page
(:mod:`~radixserve.memory.window_host`); loaded back, a page without window KV is a
tombstone. A match walks the whole L1 path (the load-back continues from its end, never
from a cut inside L1), loads what L2 holds after it, and only then is cut back to where the
last window is whole, by the same rule as every window match: a hit from L2 is never wrong.
No L3 (page files and a shared store hold whole pages of one layout).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from radixserve.memory.hi_radix_cache import HiRadixCache
from radixserve.memory.hierarchy import KVHierarchy
from radixserve.memory.radix_cache import RadixCache
from radixserve.memory.swa_cache import SWARadixCache
from radixserve.memory.tree_node import MatchResult, TreeNode
from radixserve.memory.window_pool import WindowedPageAllocator

__all__ = ["SWAHiRadixCache"]


class SWAHiRadixCache(HiRadixCache, SWARadixCache):
    """A sliding-window radix cache whose evicted pages move to L2 (module docstring)."""

    def __init__(
        self, allocator: WindowedPageAllocator, page_size: int, hierarchy: KVHierarchy
    ) -> None:
        if hierarchy.disk is not None:
            raise ValueError("a window pool's hierarchical cache has no L3")
        super().__init__(allocator, page_size, hierarchy)

    def _match_l1(self, tokens: Sequence[int], namespace: Hashable | None) -> MatchResult:
        return RadixCache.match_prefix(self, tokens, namespace, record_stats=False)

    def _usable(
        self, tokens: Sequence[int], namespace: Hashable | None, m: MatchResult
    ) -> MatchResult:
        return self._cut_back(tokens, namespace, m)

    def _add_loaded_leaf(
        self, parent: TreeNode, key: tuple[int, ...], pages: list[int]
    ) -> TreeNode:
        return SWARadixCache._add_leaf(self, parent, key, pages)
