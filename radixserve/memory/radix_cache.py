"""The radix prefix cache: a radix tree over token ids whose edges own KV pages.

::

    namespace None                  namespace "tenant-b"  (separate roots: never share KV)
        root                            root
        ├─ [sys prompt A: 3 pages] ─┬─ [chat 1: 2 pages]   <- leaf, lock_ref 0: evictable
        │                           └─ [chat 2: 5 pages]   <- locked by a running request
        └─ [sys prompt B: 4 pages]

Each edge holds a whole number of pages (``len(key) == page_size * len(pages)``). Children
are keyed by their first token (page_size 1) or by the tuple of their first page of tokens,
so a step down the tree is one dict lookup and one slice comparison of the edge. Only whole
pages are shared: a request's partial last page stays private to it and is never inserted.

Page states (every page is in exactly one): free (allocator), cached-and-evictable (in the
tree, ``lock_ref == 0``), in use (in the tree with ``lock_ref > 0``, or a request's private
page). ``free + evictable + in_use == num_pages``; :meth:`RadixCache.check_invariants`
verifies it along with everything else.

Request lifecycle (what the scheduler does)::

    m = cache.match_prefix(prompt[:-1], ns)     # page-aligned hit; may split an edge
    cache.lock(m.node)                         # lock BEFORE any alloc: alloc may evict
    node, pages = m.node, m.pages + allocator.alloc(n_more)
    ... each prefill chunk writes KV for more tokens ...
    node, pages, _ = cache.cache_prefix(tokens_with_kv, pages, node, ns)
    ... at finish / abort / retract:
    c = cache.cache_prefix(tokens_with_kv, pages, node, ns)   # (or skip caching on abort)
    cache.unlock(c.node)
    allocator.free(c.pages[c.cached_len // page_size:])       # the private tail

Eviction takes least recently used unreferenced leaves first (``lru.EvictableLeaves``: a
set plus a heap with lazy invalidation, maintained incrementally, never a tree scan);
removing a leaf may make its parent an unreferenced leaf, which joins the index then.
Access times come from a monotonic counter (not wall time), so ties are deterministic.
Leased leaves (a session's path between its turns, :mod:`~radixserve.memory.leases`) sit in
a second index and go only when nothing unleased is left, after their lease yields; other
orders than LRU (``--eviction-policy``, :mod:`~radixserve.memory.eviction`) re-key both.

Complexity (n = nodes, L = query length, d = depth of the matched path in nodes):
    match_prefix / insert / cache_prefix  O(d) dict lookups + O(L) token compares in C slices
    lock / unlock                         O(d)
    evict                                 O(log n) per leaf removed (all its pages at once) or
                                          trimmed (its tail pages, plus a C copy of its key)
    gauges                                O(1)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from radixserve.memory.allocator import PageAllocator
from radixserve.memory.eviction.control import EvictionControl
from radixserve.memory.leases import LeaseTable
from radixserve.memory.lru import EvictableLeaves
from radixserve.memory.miss_report import MissLog
from radixserve.memory.pins import PinTable
from radixserve.memory.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from radixserve.memory.kv_events import KVEventRecorder
from radixserve.memory.tree_node import (
    CachedPrefix,
    CacheStats,
    MatchResult,
    TreeNode,
    common_prefix,
)

__all__ = ["CacheStats", "CachedPrefix", "MatchResult", "RadixCache"]


class RadixCache(PrefixCache):
    """Radix tree of cached token prefixes over the KV pages of one pool.

    Registers itself as ``allocator``'s evictor. With the cache turned off the engine builds
    :class:`~radixserve.memory.no_cache.NoPrefixCache` instead (same interface, no reuse).
    """

    reuses_prefixes = True  # a request may wait for another to compute a shared prefix

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._queried = self._hit = self._evicted = self._inserted = 0
        self._next_id = 0
        self._clock = 0
        # The order of eviction (lru by default; memory.eviction): set before the indexes exist.
        self.eviction = EvictionControl(self._rekey, allocator.num_pages, page_size)
        self._init_tree()
        self.pins = PinTable(self, budget_pages=0)  # the engine sets the budget
        self.leases = LeaseTable(self)  # session leases (the engine sets their config)
        self.listener: KVEventRecorder | None = None  # KV events (the engine sets one when asked)
        self.misses: MissLog | None = MissLog(self)  # eviction records, miss reports
        allocator.set_evictor(self.evict, lambda: self.num_evictable_pages)

    def _init_tree(self) -> None:
        self._roots: dict[Hashable | None, TreeNode] = {}
        key = self.eviction.key
        self._lru = EvictableLeaves(key)  # unreferenced, unleased leaves: evicted first
        self._leased_lru = EvictableLeaves(key)  # unreferenced leased leaves (memory.leases)
        self._leased_pages = 0  # pages on some leased path
        self._tree_pages = 0
        self._protected = 0
        self._root(None)

    # ---------------------------------------------------------------- gauges & counters
    @property
    def num_cached_pages(self) -> int:
        """Pages held by the tree (evictable + protected)."""
        return self._tree_pages

    @property
    def num_evictable_pages(self) -> int:
        """Tree pages no running request references: freeable by :meth:`evict`."""
        return self._tree_pages - self._protected

    @property
    def num_protected_pages(self) -> int:
        """Tree pages on some locked path (in use)."""
        return self._protected

    @property
    def num_leased_pages(self) -> int:
        """Tree pages on some session's leased path (evicted only after every unleased one)."""
        return self._leased_pages

    @property
    def total_cached_tokens(self) -> int:
        return self._tree_pages * self.page_size

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self._queried, self._hit, self._evicted, self._inserted)

    # ---------------------------------------------------------------- tree helpers
    def _root(self, namespace: Hashable | None) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = TreeNode(self._new_id(), (), [], None, 0, 0, namespace)
            self._roots[namespace] = root
        return root

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _child_key(self, key: tuple[int, ...], start: int = 0) -> object:
        return key[start] if self.page_size == 1 else key[start : start + self.page_size]

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut ``child``'s edge after ``m`` tokens; returns the new upper node.

        ``child`` keeps its identity (requests locked on it stay valid) and becomes the lower
        part; the upper node inherits its lock_ref (every lock through ``child`` passes it).
        """
        ps = self.page_size
        parent = child.parent
        assert parent is not None
        upper = TreeNode(
            self._new_id(),
            child.key[:m],
            child.pages[: m // ps],
            parent,
            parent.depth + m,
            child.last_access,
        )
        upper.lock_ref = child.lock_ref
        upper.lease_ref = child.lease_ref
        upper.hits, upper.priority = child.hits, child.priority
        if child.loaded != (0, 0):  # pages loaded from L2 / L3: the leading ones go up
            l2, l3 = child.loaded
            up2 = min(l2, m // ps)
            up3 = min(l3, m // ps - up2)
            upper.loaded, child.loaded = (up2, up3), (l2 - up2, l3 - up3)
        parent.children[self._child_key(child.key)] = upper
        child.key = child.key[m:]
        child.pages = child.pages[m // ps :]
        if child.page_keys is not None:
            upper.page_keys, child.page_keys = (
                child.page_keys[: m // ps],
                child.page_keys[m // ps :],
            )
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    def _walk(
        self, root: TreeNode, key: tuple[int, ...], want_node: bool
    ) -> tuple[TreeNode, int, list[int]]:
        """Follow ``key`` (page-aligned) down from ``root``, refreshing access times.

        Returns ``(node, matched, pages)``. A match ending inside an edge splits it when a node
        is needed there (``want_node``, or ``key`` goes on and a leaf will hang there);
        otherwise ``node`` is the last node passed whole.
        """
        ps = self.page_size
        self._clock += 1
        tick = self._clock
        node, pos, n = root, 0, len(key)
        pages: list[int] = []
        while pos < n:
            child = node.children.get(key[pos] if ps == 1 else key[pos : pos + ps])
            if child is None:
                break
            child.last_access = tick
            child.hits += 1
            edge = child.key
            if key[pos : pos + len(edge)] == edge:
                pages += child.pages
                pos += len(edge)
                node = child
                continue
            m = common_prefix(edge, key, pos, ps)
            if want_node or pos + m < n:
                node = self._split(child, m)
                pages += node.pages
            else:
                pages += child.pages[: m // ps]
            pos += m
            break
        return node, pos, pages

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int]) -> TreeNode:
        if parent.parent is not None and parent.lock_ref == 0 and not parent.children:
            self._unindex(parent)  # its heap entry goes stale
        leaf = TreeNode(self._new_id(), key, pages, parent, parent.depth + len(key), self._clock)
        parent.children[self._child_key(key)] = leaf
        self._tree_pages += len(pages)
        self._inserted += len(pages)
        self._lru.add(leaf)
        if self.listener is not None:
            self.listener.stored(leaf)
        return leaf

    def _remove_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key)]
        self._unindex(node)
        node.alive = False
        self._tree_pages -= len(node.pages)
        self._before_evict(node, 0)
        self.allocator.free(node.pages)
        if parent.parent is None:
            if not parent.children and parent.namespace is not None:
                del self._roots[parent.namespace]  # don't keep one empty root per past tenant
        elif not parent.children and parent.lock_ref == 0:
            self._index(parent)

    def _rekey(self, key: Callable[[TreeNode], Any]) -> None:
        """The eviction policy changed: both leaf indexes follow ``key`` (O(leaves), once)."""
        self._lru.rekey(key)
        self._leased_lru.rekey(key)

    def _index(self, leaf: TreeNode) -> None:
        """``leaf`` just became an unreferenced leaf: into the leased or the unleased index."""
        (self._leased_lru if leaf.lease_ref else self._lru).add(leaf)

    def _unindex(self, node: TreeNode) -> None:
        self._lru.discard(node)
        self._leased_lru.discard(node)

    # ---------------------------------------------------------------- public API
    def match_prefix(
        self, tokens: Sequence[int], namespace: Hashable | None = None, record_stats: bool = True
    ) -> MatchResult:
        """Longest cached prefix of ``tokens``, rounded down to whole pages.

        Mutates the tree: refreshes the access time of every node on the matched path and,
        when the match ends inside an edge, splits that edge so that ``node`` ends exactly at
        ``matched_len``. Does NOT lock: call :meth:`lock` before any allocation.
        ``record_stats`` adds to the queried/hit counters (turn it off for speculative
        look-ups, e.g. a scheduling policy scoring queued requests).
        """
        root = self._roots.get(namespace)
        n_full = len(tokens) // self.page_size * self.page_size
        pages: list[int]
        if root is None:
            # An unregistered root: a miss must not leave one empty root behind per namespace
            # (per-request salts would leak). Roots are inert: lock/unlock ignore them.
            node, matched, pages = TreeNode(self._new_id(), (), [], None, 0, 0, namespace), 0, []
        elif n_full == 0:
            node, matched, pages = root, 0, []
        else:
            node, matched, pages = self._walk(root, tuple(tokens[:n_full]), want_node=True)
            self.pins.touch(node)  # a hit on a pinned prefix extends its pin
        if record_stats:
            self.record_lookup(len(tokens), matched)
        return MatchResult(pages, matched, node)

    def take_loaded(self, node: TreeNode) -> tuple[int, int]:
        """Pages on the path root..``node`` that a lower tier (L2, L3) loaded and no request
        has used since; they count as used now (usage says where cached tokens came from)."""
        l2 = l3 = 0
        while node.parent is not None:
            if node.loaded != (0, 0):
                a, b = node.loaded
                l2, l3 = (
                    l2 + min(a, len(node.pages)),
                    l3 + min(b, len(node.pages) - min(a, len(node.pages))),
                )
                node.loaded = (0, 0)
            node = node.parent
        return l2, l3

    def record_lookup(self, queried: int, hit: int) -> None:
        """Count one look-up of ``queried`` tokens of which ``hit`` were cached (for a caller
        that matched with ``record_stats=False`` and decided afterwards that it counts)."""
        self._queried += queried
        self._hit += hit

    def peek_prefix_len(self, tokens: Sequence[int], namespace: Hashable | None = None) -> int:
        """Length of the cached page-aligned prefix of ``tokens``, without touching the tree."""
        return self._peek(tokens, namespace, None)

    def _peek(
        self, tokens: Sequence[int], namespace: Hashable | None, pages: list[int] | None
    ) -> int:
        """:meth:`peek_prefix_len`'s walk; appends the matched pages to ``pages`` if given
        (a subclass that judges a match by its pages, as the sliding-window cache does)."""
        root = self._roots.get(namespace)
        ps = self.page_size
        n = len(tokens) // ps * ps
        if root is None or n == 0:
            return 0
        key, node, pos = tuple(tokens[:n]), root, 0
        while pos < n:
            child = node.children.get(key[pos] if ps == 1 else key[pos : pos + ps])
            if child is None:
                break
            if key[pos : pos + len(child.key)] != child.key:
                m = common_prefix(child.key, key, pos, ps)
                if pages is not None:
                    pages += child.pages[: m // ps]
                return pos + m
            if pages is not None:
                pages += child.pages
            pos += len(child.key)
            node = child
        return pos

    def lock(self, node: TreeNode) -> None:
        """Take one reference on the path root..``node``: none of it can be evicted until :meth:`unlock`."""
        if node.parent is None:
            return
        if not node.alive:
            raise RuntimeError(
                "lock() on an evicted node: lock right after match_prefix, before any allocation"
            )
        node.holders += 1
        while node.parent is not None:
            if node.lock_ref == 0:
                self._protected += len(node.pages)
                if not node.children:
                    self._unindex(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Drop one reference taken by :meth:`lock` (or handed over by :meth:`cache_prefix`)."""
        if node.parent is None:
            return
        if node.holders <= 0 or not node.alive:
            raise RuntimeError(f"unlock() without a matching lock: {node!r}")
        node.holders -= 1
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.pages)
                if not node.children:
                    self._index(node)
            node = node.parent

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: Hashable | None = None
    ) -> int:
        """Insert the whole pages of ``tokens`` backed by ``pages`` (one page per page_size tokens).

        Returns how many leading tokens were already cached: the tree keeps its own pages for
        them and the caller frees its duplicates ``pages[:returned // page_size]`` (unless they
        are the tree's own, as for a request that matched them). The tree takes ownership of
        the following whole pages; a partial last page is ignored (stays the caller's). The new
        nodes are unlocked (evictable). May split an edge.
        """
        ps = self.page_size
        n_full = len(tokens) // ps
        if len(pages) < n_full:
            raise ValueError(f"{len(tokens)} tokens need {n_full} whole pages, got {len(pages)}")
        if n_full == 0:
            return 0
        key = tuple(tokens[: n_full * ps])
        node, pos, _ = self._walk(self._root(namespace), key, want_node=False)
        if pos < len(key):
            self._add_leaf(node, key[pos:], list(pages[pos // ps : n_full]))
        return pos

    def cache_prefix(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        node: TreeNode,
        namespace: Hashable | None = None,
        release: Callable[[list[int]], None] | None = None,
    ) -> CachedPrefix:
        """Move a request's finished whole pages into the tree and re-point its lock.

        ``tokens`` are exactly the tokens whose KV is in ``pages`` (one page per page_size
        tokens, the last maybe partial; extra pages allocated ahead may follow); ``node`` is
        the node the request holds locked (from :meth:`match_prefix` + :meth:`lock` or a
        previous ``cache_prefix``), backing ``pages[:node.depth // page_size]``.

        Inserts the whole pages, frees the request's own copies of pages that another request
        cached meanwhile, locks the new deepest node and unlocks ``node``. Returns the node the
        request now holds and its page list: tree pages for the first ``cached_len`` tokens,
        its private pages after. ``release`` takes the request's duplicate pages instead of
        the allocator (a caller with a step in flight that may still read them frees them later).
        """
        ps = self.page_size
        n_full = len(tokens) // ps
        held = node.depth // ps
        if len(pages) < n_full:
            raise ValueError(f"{len(tokens)} tokens need {n_full} whole pages, got {len(pages)}")
        if n_full < held:
            raise ValueError(
                f"request holds {node.depth} cached tokens but passed only {len(tokens)}"
            )
        if n_full == held:
            return CachedPrefix(node, list(pages), held * ps)
        key = tuple(tokens[: n_full * ps])
        new_node, pos, tree_pages = self._walk(self._root(namespace), key, want_node=True)
        if pos < node.depth:
            raise RuntimeError(
                "cache_prefix: tokens do not extend the locked node's prefix (wrong node or namespace?)"
            )
        if pos < len(key):
            tail = list(pages[pos // ps : n_full])
            new_node = self._add_leaf(new_node, key[pos:], tail)
            tree_pages += tail
        if pos // ps > held:
            # Another request cached these tokens after we matched: its pages win, ours go back.
            (release or self.allocator.free)(list(pages[held : pos // ps]))
        self.lock(new_node)
        self.unlock(node)
        return CachedPrefix(new_node, tree_pages + list(pages[n_full:]), n_full * ps)

    def evict(self, n_pages: int) -> int:
        """Free up to ``n_pages`` tree pages, least recently used unreferenced leaves first.

        A leaf with more pages than still needed loses only its tail pages (it stays cached,
        shorter). Returns the pages freed: ``min(n_pages, num_evictable_pages)``.
        """
        freed = 0
        while freed < n_pages:
            need = n_pages - freed
            node = self._lru.peek_lru()
            if node is None:  # unleased pages are gone: the oldest lease yields its tail
                got = self._trim_oldest_lease(need)
                if got:
                    freed += got
                    continue
                if self.leases.yield_one():  # its last node is shared: released whole
                    continue
                break
            if len(node.pages) > need:
                self._drop_tail(node, need)
                freed += need
                break
            freed += len(node.pages)
            self._remove_leaf(node)
        self._evicted += freed
        return freed

    def _drop_tail(self, node: TreeNode, n: int) -> None:
        """Free the last ``n`` of leaf ``node``'s pages (fewer than it has): it stays, shorter."""
        ps = self.page_size
        self._before_evict(node, len(node.pages) - n)
        drop = node.pages[-n:]
        del node.pages[-n:]
        if node.page_keys is not None:
            del node.page_keys[-n:]
        node.key = node.key[: -n * ps]
        node.depth -= n * ps
        node.path_hash = None
        self._tree_pages -= n
        if node.lease_ref:
            self._leased_pages -= n
        self.allocator.free(drop)

    def _trim_oldest_lease(self, need: int) -> int:
        """Take up to ``need`` pages from the tail of the oldest lease's path, when its last
        node is its own (unlocked, no children, no other lease); the lease keeps the rest.
        Returns the pages freed (0: that lease must yield whole, or there is none)."""
        lease = self.leases.oldest()
        if lease is None:
            return 0
        node = lease.node
        if node.lock_ref or node.children or node.lease_ref != 1 or not node.alive:
            return 0
        if len(node.pages) > need:
            self._drop_tail(node, need)
            self.leases.trimmed(lease, need, node)
            return need
        n, parent = len(node.pages), node.parent
        self._leased_pages -= n
        self._remove_leaf(node)
        self.leases.trimmed(lease, n, parent)
        return n

    def add_lease(self, node: TreeNode) -> None:
        """One more session lease on the path root..``node`` (:mod:`~radixserve.memory.leases`).

        O(depth). A leased unreferenced leaf moves to the leased index: eviction takes it
        only after every unleased leaf (and only once its lease yields)."""
        if node.parent is None or not node.alive:
            raise RuntimeError(f"add_lease() on a root or an evicted node: {node!r}")
        while node.parent is not None:
            if node.lease_ref == 0:
                self._leased_pages += len(node.pages)
                if node.lock_ref == 0 and not node.children:
                    self._lru.discard(node)
                    self._leased_lru.add(node)
            node.lease_ref += 1
            node = node.parent

    def drop_lease(self, node: TreeNode) -> None:
        """Drop one lease taken by :meth:`add_lease`; the path's pages become ordinary cache."""
        while node.parent is not None:
            node.lease_ref -= 1
            if node.lease_ref == 0:
                self._leased_pages -= len(node.pages)
                if node.lock_ref == 0 and not node.children:
                    self._leased_lru.discard(node)
                    self._lru.add(node)
            node = node.parent

    def _before_evict(self, node: TreeNode, keep: int) -> None:
        """``node.pages[keep:]`` are about to leave L1 (a tiered cache demotes them too)."""
        if self.misses is not None:
            self.misses.evicted(node, keep)
        if self.listener is not None:
            self.listener.removed(node, keep)

    def nodes(self) -> Iterator[TreeNode]:
        """Every node below the namespace roots, each after its parent (a KV-event snapshot
        walks them so)."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node

    def back_up(self, node: TreeNode) -> None:
        """Hook: copy the path to ``node`` to a lower tier now, if there is one (an expired pin)."""

    def reset(self) -> None:
        """Drop every cached prefix and free its pages. Requires no locks held; counters survive."""
        self.pins.clear()
        self.leases.clear()
        if self._protected or any(r.lock_ref for r in self._roots.values()):
            raise RuntimeError(
                f"reset() with {self._protected} pages still locked by running requests"
            )
        if self.misses is not None:  # a flush is no policy's eviction: recorded as flushed
            self.misses.flushed()
        self.eviction.flushed()
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.alive = False
            if node.pages:
                self.allocator.free(node.pages)
        self._init_tree()
        if self.listener is not None:
            self.listener.cleared()

    def check_invariants(self, private_pages: Iterable[int] = ()) -> None:
        """Verify the whole page accounting and tree structure (O(tree); tests call it often).

        ``private_pages``: every page running requests hold outside the tree. Raises
        ``AssertionError`` naming the first broken invariant.
        """
        from radixserve.memory._invariants import check_cache_invariants

        check_cache_invariants(self, private_pages)
        self.pins.check_invariants()
        self.leases.check_invariants(self.nodes())

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, cached_pages={self._tree_pages}, "
            f"evictable={self.num_evictable_pages}, protected={self._protected}, free={self.allocator.num_free})"
        )
