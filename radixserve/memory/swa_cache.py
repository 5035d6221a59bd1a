"""The radix cache of a sliding-window model: global pages as usual, window pages that can go.

Same tree, same global pages and locks as :class:`~radixserve.memory.radix_cache.RadixCache`;
each global page may also carry a window-layer page (:mod:`~radixserve.memory.window_pool`).
What this cache adds::

    lock(node)       also references the window pages of the node's LAST WINDOW (the pages
                     a row right after the node sees); unlock drops them. A running request
                     keeps its own last window through its lock and its private pages.
    tombstones       under window-pool pressure the window pages of unreferenced tree pages
                     go, least recently used node first (internal nodes too), the global
                     pages stay: the prefix is still there for the global layers.
    match_prefix     a hit of m tokens is cut back to the longest m' <= m whose last window
                     is whole (every window page of [m' - window + 1, m') present), so the
                     first new row always finds the KV its window needs: hits are never wrong.
                     peek_prefix_len (policy scoring) applies the same cut-back.
    cache_prefix     when the tree's copy of a request's freshly computed pages is a
                     tombstone, the request's window pages move onto the tree's pages.

Eviction of window pages is an LRU over nodes that may hold unreferenced window pages
(``lru.EvictableLeaves`` used as a node index: a set plus a lazily invalidated heap),
O(log n) per node visited plus the pages it frees.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

from radixserve.memory.lru import EvictableLeaves
from radixserve.memory.radix_cache import RadixCache
from radixserve.memory.tree_node import CachedPrefix, MatchResult, TreeNode
from radixserve.memory.window_pool import WindowedPageAllocator, first_window_page

__all__ = ["SWARadixCache"]


class SWARadixCache(RadixCache):
    """Radix cache over a :class:`WindowedPageAllocator` (see the module docstring)."""

    def __init__(self, allocator: WindowedPageAllocator, page_size: int) -> None:
        super().__init__(allocator, page_size)
        self.window = allocator.window
        self.window.allocator.set_evictor(self.evict_window, lambda: self.window.num_evictable)
        self.window_evicted_pages = 0  # window pages tombstoned so far (monotonic)
        self.window_cut_tokens = 0  # matched tokens given up because their window was gone

    def _init_tree(self) -> None:
        super()._init_tree()
        # Nodes that may hold unreferenced window pages, least recently used first.
        self._wlru = EvictableLeaves()

    # ---------------------------------------------------------------- gauges
    @property
    def num_window_in_use(self) -> int:
        """Window pages a running request (or a lock) needs now."""
        w = self.window
        return w.num_window_pages - w.allocator.num_free - w.num_evictable

    # ---------------------------------------------------------------- window of a path
    def _last_window(self, node: TreeNode) -> list[tuple[TreeNode, list[int]]]:
        """The (node, its pages) on the path root..``node`` inside the node's last window."""
        lo, _ = self.window.window_span(node.depth)
        ps = self.page_size
        out: list[tuple[TreeNode, list[int]]] = []
        n = node
        while n.parent is not None:
            end = n.depth // ps
            start = end - len(n.pages)
            if end <= lo:
                break
            out.append((n, n.pages[max(0, lo - start) :]))
            n = n.parent
        return out

    def _whole_window_len(self, pages: list[int], matched: int) -> int:
        """The longest page-aligned m' <= ``matched`` whose last window's pages are all present:
        the one cut-back rule, which both :meth:`match_prefix` and :meth:`peek_prefix_len`
        apply (a policy ranking requests by their peeked hit must see the hit they will get)."""
        ps, w, table = self.page_size, self.window.window, self.window.table
        k = matched // ps
        while k > 0:
            lo = first_window_page(k * ps, w, ps)
            j = k - 1
            while j >= lo and table[pages[j]] >= 0:
                j -= 1
            if j < lo:
                return k * ps
            k = j  # any end after page j still needs page j
        return 0

    # ---------------------------------------------------------------- tree hooks
    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int]) -> TreeNode:
        leaf = super()._add_leaf(parent, key, pages)
        w = self.window
        loose = 0
        for g in pages:
            w.in_tree[g] = 1
            if w.table[g] >= 0 and not w.wref[g]:
                loose += 1
        if loose:
            w.num_evictable += loose
            self._wlru.add(leaf)
        return leaf

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        upper = super()._split(child, m)
        if child in self._wlru:  # some of its loose window pages moved up
            self._wlru.add(upper)
        return upper

    # ---------------------------------------------------------------- public API
    def match_prefix(
        self, tokens: Sequence[int], namespace: Hashable | None = None, record_stats: bool = True
    ) -> MatchResult:
        """:meth:`RadixCache.match_prefix`, cut back to where the last window is whole."""
        m = self._cut_back(tokens, namespace, super().match_prefix(tokens, namespace, False))
        if record_stats:
            self.record_lookup(len(tokens), m.matched_len)
        return m

    def _cut_back(
        self, tokens: Sequence[int], namespace: Hashable | None, m: MatchResult
    ) -> MatchResult:
        """``m`` cut back to where its last window is whole (re-matched there, so the node
        ends at the cut; ``m`` is a plain L1 match of ``tokens``, or one extended from L2)."""
        usable = self._whole_window_len(m.pages, m.matched_len)
        if usable < m.matched_len:
            self.window_cut_tokens += m.matched_len - usable
            m = RadixCache.match_prefix(self, tokens[:usable], namespace, record_stats=False)
        return m

    def peek_prefix_len(self, tokens: Sequence[int], namespace: Hashable | None = None) -> int:
        """:meth:`RadixCache.peek_prefix_len`, cut back as :meth:`match_prefix` cuts it."""
        pages: list[int] = []
        matched = self._peek(tokens, namespace, pages)
        return self._whole_window_len(pages, matched)

    def lock(self, node: TreeNode) -> None:
        super().lock(node)
        if node.parent is None:
            return
        w = self.window
        table, wref = w.table, w.wref
        for _, pages in self._last_window(node):
            for g in pages:
                if not wref[g] and table[g] >= 0:
                    w.num_evictable -= 1
                wref[g] += 1

    def unlock(self, node: TreeNode) -> None:
        super().unlock(node)
        if node.parent is None:
            return
        w = self.window
        table, wref = w.table, w.wref
        for n, pages in self._last_window(node):
            loose = 0
            for g in pages:
                wref[g] -= 1
                if not wref[g] and table[g] >= 0:
                    loose += 1
            if loose:
                w.num_evictable += loose
                if n not in self._wlru:
                    self._wlru.add(n)

    def cache_prefix(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        node: TreeNode,
        namespace: Hashable | None = None,
        release: Callable[[list[int]], None] | None = None,
    ) -> CachedPrefix:
        """:meth:`RadixCache.cache_prefix`; where the tree's copy of the request's duplicate
        pages lacks window pages the request still needs, its own move over first."""
        dups: list[int] = []
        res = super().cache_prefix(tokens, pages, node, namespace, release=dups.extend)
        if dups:
            held = node.depth // self.page_size
            lo = first_window_page(len(tokens), self.window.window, self.page_size)
            table = self.window.table
            for i, mine in enumerate(dups):
                theirs = res.pages[held + i]
                if held + i >= lo and table[theirs] < 0 <= table[mine]:
                    self.window.move(mine, theirs)  # inside the new lock's window: in use
            (release or self.allocator.free)(dups)
        return res

    def evict_window(self, n_pages: int) -> int:
        """Tombstone up to ``n_pages`` window pages of unreferenced tree pages, least recently
        used node first, a node's leading pages first (its last window serves hits longest)."""
        w = self.window
        table, wref = w.table, w.wref
        freed: list[int] = []
        while len(freed) < n_pages:
            node = self._wlru.peek_lru()
            if node is None:
                break
            left = False
            if node.alive:
                for g in node.pages:
                    if table[g] >= 0 and not wref[g]:
                        if len(freed) < n_pages:
                            freed.append(w.unmap(g))
                        else:
                            left = True
                            break
            if not left:
                self._wlru.discard(node)
        w.num_evictable -= len(freed)
        w.allocator.free(freed)
        self.window_evicted_pages += len(freed)
        return len(freed)

    def check_invariants(self, private_pages: Iterable[int] = ()) -> None:
        """:meth:`RadixCache.check_invariants`, then the window pool's accounting
        (:func:`~radixserve.memory._window_invariants.check_window_invariants`)."""
        private = list(private_pages)
        super().check_invariants(private)
        from radixserve.memory._window_invariants import check_window_invariants

        check_window_invariants(self, private)
