"""The radix cache over a KV hierarchy: L1 evictions demote, matches load back from L2/L3.

::

    match_prefix(tokens)                          evict(n)   (the allocator asks when short)
      1. walk L1 as RadixCache does                 LRU unreferenced leaves, as RadixCache,
      2. key the following whole pages             but each page leaving L1 is first copied
         (chained prefix hash, page_hash)          to L2 (unless L2 has its key): demoted,
      3. leading keys L2/L3 hold -> fresh L1       not dropped. L2 spills its LRU pages to
         pages (allocating may evict/demote        L3 when it needs room.
         others; the matched path is locked)
      4. a new leaf under the match holds them
      -> one MatchResult over the whole prefix

The tree is still the L1 index: a node exists while its pages are in L1. Where else a node's
KV lives is known per page by its key (:meth:`HiRadixCache.tiers`). Each tier keeps its own
accounting and each page of each tier is in exactly one state (L1: free / evictable / in
use; L2: free / cached; L3: a verified file or nothing); :meth:`check_invariants` checks L1
and L2 together.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from radixserve.memory.allocator import PageAllocator
from radixserve.memory.hierarchy import KVHierarchy
from radixserve.memory.page_hash import PageKey
from radixserve.memory.radix_cache import RadixCache
from radixserve.memory.tree_node import MatchResult, TreeNode, node_page_keys


class HiRadixCache(RadixCache):
    """A :class:`RadixCache` whose evicted pages move down ``hierarchy`` instead of vanishing."""

    def __init__(self, allocator: PageAllocator, page_size: int, hierarchy: KVHierarchy) -> None:
        if hierarchy.hasher.page_size != page_size:
            raise ValueError(
                f"hierarchy page_size {hierarchy.hasher.page_size} != cache page_size {page_size}"
            )
        self.hierarchy = hierarchy
        super().__init__(allocator, page_size)

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int]) -> TreeNode:
        """As :meth:`RadixCache._add_leaf`; a shared L3 gets the new pages at once."""
        leaf = super()._add_leaf(parent, key, pages)
        if self.hierarchy.disk is not None and self.hierarchy.disk.write_through:
            self.hierarchy.write_through(leaf.pages, self.page_keys(leaf))
        return leaf

    # ------------------------------------------------------------------ keys and tiers
    def page_keys(self, node: TreeNode) -> list[PageKey]:
        """The key of each page of ``node`` (computed once per node, up the path as needed)."""
        return node_page_keys(node, self.hierarchy.hasher)

    def tiers(self, node: TreeNode) -> list[frozenset[str]]:
        """Where each page of ``node`` lives: always L1 (it is in the tree), plus L2/L3 copies."""
        return [frozenset({"L1"}) | self.hierarchy.where(k) for k in self.page_keys(node)]

    # ------------------------------------------------------------------ demotion
    def _before_evict(self, node: TreeNode, keep: int) -> None:
        super()._before_evict(node, keep)
        self.hierarchy.demote(node.pages[keep:], self.page_keys(node)[keep:])

    def back_up(self, node: TreeNode) -> None:
        """Copy the pages of the path root..``node`` to L2 now (those it lacks); they stay in L1."""
        path: list[TreeNode] = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        for n in reversed(path):
            self.hierarchy.demote(n.pages, self.page_keys(n))

    # ------------------------------------------------------------------ load-back
    def match_prefix(
        self, tokens: Sequence[int], namespace: Hashable | None = None, record_stats: bool = True
    ) -> MatchResult:
        """Longest cached prefix across L1, L2 and L3; the L2/L3 part is copied into new L1
        pages (a new unlocked leaf) before this returns, so the result is all L1 pages.

        Otherwise as :meth:`RadixCache.match_prefix`: mutates the tree and does NOT lock;
        lock the returned node before any allocation.
        """
        m = self._match_l1(tokens, namespace)
        if len(tokens) - m.matched_len >= self.page_size:
            before = self.hierarchy.stats
            m = self._load_back(tokens, namespace, m)
            after = self.hierarchy.stats
            if m.node.parent is not None:  # the new leaf remembers where its pages came from
                m.node.loaded = (
                    after.loaded_l2_pages - before.loaded_l2_pages,
                    after.loaded_l3_pages - before.loaded_l3_pages,
                )
        m = self._usable(tokens, namespace, m)
        if record_stats:
            self.record_lookup(len(tokens), m.matched_len)
        return m

    def _match_l1(self, tokens: Sequence[int], namespace: Hashable | None) -> MatchResult:
        """The L1 part of a match: the whole cached path (the load-back goes on from its end)."""
        return super().match_prefix(tokens, namespace, record_stats=False)

    def _usable(
        self, tokens: Sequence[int], namespace: Hashable | None, m: MatchResult
    ) -> MatchResult:
        """What of the L1 + loaded match a request may use (all of it here)."""
        return m

    def _add_loaded_leaf(
        self, parent: TreeNode, key: tuple[int, ...], pages: list[int]
    ) -> TreeNode:
        """The leaf of pages loaded from L2/L3: not :meth:`_add_leaf`, which would write them
        through to L3 again."""
        return RadixCache._add_leaf(self, parent, key, pages)

    def _load_back(
        self, tokens: Sequence[int], namespace: Hashable | None, m: MatchResult
    ) -> MatchResult:
        ps = self.page_size
        start, end = m.matched_len, len(tokens) // ps * ps
        prev = (
            self.page_keys(m.node)[-1]
            if m.node.parent is not None
            else self.hierarchy.hasher.seed(namespace)
        )
        keys = self.hierarchy.hasher.chain(prev, tokens[start:end])
        if self.hierarchy.available(keys[:1]) == 0:
            return m
        self.lock(m.node)  # allocating may evict: never the path we extend
        try:
            want = min(
                self.hierarchy.available(keys), self.allocator.num_free + self.num_evictable_pages
            )
            # The evictions that make room demote into L2; they must not push out what we load.
            with self.hierarchy.hold(keys[:want]):
                pages = self.allocator.alloc(want)
            try:
                n = self.hierarchy.load(keys[:want], pages)
            except BaseException:
                self.allocator.free(pages)
                raise
            self.allocator.free(pages[n:])
        finally:
            self.unlock(m.node)
        if n == 0:
            return m
        # A namespace root may have been dropped by the evictions (or never registered).
        parent = m.node if m.node.parent is not None else self._root(namespace)
        leaf = self._add_loaded_leaf(parent, tuple(tokens[start : start + n * ps]), pages[:n])
        leaf.page_keys = keys[:n]
        return MatchResult(m.pages + pages[:n], start + n * ps, leaf)

    # ------------------------------------------------------------------ lifecycle
    def persist(self) -> int:
        """Write every L1 and L2 page to L3 (a clean shutdown does this so a restart is warm);
        returns the files written."""
        pages: list[int] = []
        keys: list[PageKey] = []
        for node in self.nodes():
            pages += node.pages
            keys += self.page_keys(node)
        return self.hierarchy.persist(pages, keys)

    def reset(self) -> None:
        """Drop L1 and L2 (L3 is shared storage and stays; delete its directory to clear it).
        L2 first, so that KV events end with L1's AllBlocksCleared."""
        self.hierarchy.clear_host()
        super().reset()

    def check_invariants(self, private_pages: Iterable[int] = ()) -> None:
        """L1 as :meth:`RadixCache.check_invariants`, plus L2's accounting and the tree's page keys."""
        super().check_invariants(private_pages)
        self.hierarchy.check_invariants()
        for node in self.nodes():
            if node.page_keys is not None and len(node.page_keys) == len(node.pages):
                parent = node.parent
                assert parent is not None
                prev = (
                    self.page_keys(parent)[-1]
                    if parent.parent is not None
                    else self.hierarchy.hasher.seed(parent.namespace)
                )
                if self.hierarchy.hasher.chain(prev, node.key) != node.page_keys:
                    raise AssertionError(
                        f"radix cache invariant broken: stale page keys on {node!r}"
                    )
