"""The window pool's full consistency check (tests call it after every step), kept apart
from :mod:`~radixserve.memory.swa_cache` so the hot module stays small."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Protocol

from radixserve.memory.allocator import PageAllocator
from radixserve.memory.lru import EvictableLeaves
from radixserve.memory.tree_node import TreeNode
from radixserve.memory.window_pool import WindowPages


class SWACacheInternals(Protocol):
    """The state of a :class:`~radixserve.memory.swa_cache.SWARadixCache` the check reads."""

    window: WindowPages
    allocator: PageAllocator
    _wlru: EvictableLeaves

    def nodes(self) -> Iterator[TreeNode]: ...

    def _last_window(self, node: TreeNode) -> list[tuple[TreeNode, list[int]]]: ...


def _fail(msg: str) -> None:
    raise AssertionError(f"window pool invariant broken: {msg}")


def check_window_invariants(cache: SWACacheInternals, private_pages: list[int]) -> None:
    """free + evictable + in use == num_window_pages; every window page in one place;
    ``wref`` equals the locks' last windows; ``in_tree`` equals the tree's pages; every node
    holding an unreferenced window page is in the window eviction index."""
    w = cache.window
    w.allocator.check_invariants()
    tree_pages: set[int] = set()
    wref: Counter[int] = Counter()
    loose_nodes = []
    for node in cache.nodes():
        tree_pages.update(node.pages)
        if node.holders:
            for _, pages in cache._last_window(node):
                for g in pages:
                    wref[g] += node.holders
    for node in cache.nodes():
        if any(w.table[g] >= 0 and not wref[g] for g in node.pages):
            loose_nodes.append(node)
    for g in range(w.num_global_pages):
        if w.wref[g] != wref[g]:
            _fail(f"wref[{g}] = {w.wref[g]}, locks' windows reach it {wref[g]} times")
        if bool(w.in_tree[g]) != (g in tree_pages):
            _fail(
                f"in_tree[{g}] = {w.in_tree[g]} but the tree {'holds' if g in tree_pages else 'lacks'} it"
            )
    mapped = [(g, x) for g, x in enumerate(w.table) if x >= 0]
    owners = [g for g, _ in mapped]
    free_globals = cache.allocator.free_pages()
    if any(g in free_globals for g in owners):
        _fail("a free global page still maps a window page")
    private = set(private_pages)
    if any(g not in tree_pages and g not in private for g in owners):
        _fail("a window page is mapped from a global page neither in the tree nor held")
    windows = [x for _, x in mapped]
    deferred = w.deferred_pages()
    free = w.allocator.free_pages()
    everything = windows + deferred + list(free)
    if len(everything) != len(set(everything)):
        _fail("a window page is in two places (two global pages, deferred, free)")
    if len(everything) != w.num_window_pages:
        _fail(f"{len(everything)} window pages accounted for, the pool has {w.num_window_pages}")
    evictable = sum(1 for g in owners if g in tree_pages and not wref[g])
    if evictable != w.num_evictable:
        _fail(f"num_evictable {w.num_evictable}, recount {evictable}")
    for node in loose_nodes:
        if node not in cache._wlru:
            _fail(f"{node!r} holds unreferenced window pages but is not in the window index")
