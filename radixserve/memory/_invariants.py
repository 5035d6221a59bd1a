"""The full consistency check of a :class:`RadixCache` and its allocator (tests call it after every step).

Kept apart from the cache so the hot module stays small; it reads the cache's private
state on purpose, named by :class:`CacheInternals` (so this module need not import the cache's).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from radixserve.memory.allocator import PageAllocator
from radixserve.memory.lru import EvictableLeaves
from radixserve.memory.tree_node import TreeNode


class CacheInternals(Protocol):
    """The state of a :class:`~radixserve.memory.radix_cache.RadixCache` the check reads."""

    page_size: int
    allocator: PageAllocator
    _clock: int
    _roots: dict[Hashable | None, TreeNode]
    _lru: EvictableLeaves
    _leased_lru: EvictableLeaves
    _leased_pages: int
    _tree_pages: int
    _protected: int

    def _child_key(self, key: tuple[int, ...], start: int = 0) -> object: ...


def _fail(msg: str) -> None:
    raise AssertionError(f"radix cache invariant broken: {msg}")


@dataclass
class _TreeCount:
    """What one walk of the trees found, to hold against the cache's gauges and indexes."""

    pages: list[int] = field(default_factory=list)
    protected: int = 0
    leased: int = 0
    leaves: set[TreeNode] = field(default_factory=set)
    leased_leaves: set[TreeNode] = field(default_factory=set)


def check_cache_invariants(cache: CacheInternals, private_pages: Iterable[int] = ()) -> None:
    """See :meth:`RadixCache.check_invariants`."""
    alloc = cache.allocator
    alloc.check_invariants()
    private = list(private_pages)
    private_set = set(private)
    if len(private_set) != len(private):
        _fail("a private page is held twice")
    count = _TreeCount()
    for ns, root in cache._roots.items():
        _check_root(ns, root)
        _walk(cache, root, count)
    _check_gauges(cache, count)
    _check_leaf_indexes(cache, count)
    _check_page_accounting(alloc, count, private_set)


def _check_root(ns: Hashable | None, root: TreeNode) -> None:
    if (
        root.parent is not None
        or root.key
        or root.pages
        or root.depth
        or root.lock_ref
        or root.holders
    ):
        _fail(f"root of namespace {ns!r} is not a bare root")
    if root.namespace != ns:
        _fail(f"root registered under {ns!r} says namespace {root.namespace!r}")


def _walk(cache: CacheInternals, root: TreeNode, count: _TreeCount) -> None:
    """Check every node under ``root`` against its parent and children; count its pages."""
    stack = [root]
    while stack:
        node = stack.pop()
        below = 0
        for ck, child in node.children.items():
            if child.parent is not node or not child.alive:
                _fail(f"bad parent link or dead child under {node!r}")
            if ck != cache._child_key(child.key):
                _fail(f"child key {ck!r} does not match the edge of {child!r}")
            below += child.lock_ref
            stack.append(child)
        if node.parent is None:
            continue
        _check_node(cache, node, below)
        count.pages.extend(node.pages)
        if node.lease_ref > 0:
            count.leased += len(node.pages)
        if node.lock_ref > 0:
            count.protected += len(node.pages)
        elif not node.children:
            (count.leased_leaves if node.lease_ref > 0 else count.leaves).add(node)


def _check_node(cache: CacheInternals, node: TreeNode, below: int) -> None:
    """One non-root node: whole pages, depth, lock and lease references, access times."""
    assert node.parent is not None
    if not node.key or len(node.key) != cache.page_size * len(node.pages):
        _fail(f"edge is not a positive whole number of pages: {node!r}")
    if node.depth != node.parent.depth + len(node.key):
        _fail(f"depth mismatch: {node!r}")
    if node.holders < 0 or node.lock_ref != node.holders + below:
        _fail(f"lock_ref != holders + children's lock_ref: {node!r}")
    if node.last_access > cache._clock:
        _fail(f"access time from the future: {node!r}")
    if node.parent.parent is not None and node.last_access > node.parent.last_access:
        _fail(f"node used more recently than its parent (walks touch whole paths): {node!r}")
    if node.lease_ref < max((c.lease_ref for c in node.children.values()), default=0):
        _fail(f"a leased node under an unleased one: {node!r}")


def _check_gauges(cache: CacheInternals, count: _TreeCount) -> None:
    if len(set(count.pages)) != len(count.pages):
        _fail("a page appears twice in the tree")
    if len(count.pages) != cache._tree_pages:
        _fail(f"cached page gauge {cache._tree_pages} != {len(count.pages)} pages in the tree")
    if count.protected != cache._protected:
        _fail(f"protected gauge {cache._protected} != {count.protected}")
    if count.leased != cache._leased_pages:
        _fail(f"leased page gauge {cache._leased_pages} != {count.leased}")


def _check_leaf_indexes(cache: CacheInternals, count: _TreeCount) -> None:
    """Each evictable leaf, and no other node, in its index, with a usable heap entry."""
    for want, index in ((count.leaves, cache._lru), (count.leased_leaves, cache._leased_lru)):
        indexed = set(index)
        if want != indexed:
            _fail(f"evictable leaf set is off by {len(want ^ indexed)} nodes")
        newest_entry: dict[int, int] = {}
        for stored, node_id, node in index.heap_entries():
            if node.id != node_id:
                _fail("heap entry id does not match its node")
            if node in want and stored <= index.key(node):
                newest_entry[node_id] = stored
        if len(newest_entry) != len(want):
            _fail("an evictable leaf has no usable heap entry")


def _check_page_accounting(alloc: PageAllocator, count: _TreeCount, private: set[int]) -> None:
    """Every page free, cached, or private, exactly one of them."""
    free = alloc.free_pages()
    tree_set = set(count.pages)
    for a, b, what in (
        (free, tree_set, "free and cached"),
        (free, private, "free and private"),
        (tree_set, private, "cached and private"),
    ):
        if not a.isdisjoint(b):
            _fail(f"pages both {what}: {sorted(a & b)[:8]}")
    in_use = count.protected + len(private)
    evictable = len(count.pages) - count.protected
    if len(free) + evictable + in_use != alloc.num_pages:
        _fail(
            f"free {len(free)} + evictable {evictable} + in use {in_use} != {alloc.num_pages} pages"
        )
