"""The radix cache's node, its result types, and the edge-comparison helper."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, NamedTuple

from radixserve.prefix import common_prefix_len

if TYPE_CHECKING:
    from radixserve.memory.page_hash import PageKey, PrefixHasher


class TreeNode:
    """A node of :class:`~radixserve.memory.radix_cache.RadixCache`.

    The node owns the edge from its parent: ``key`` (token ids, a whole number of pages) and
    ``pages`` (one KV page id per ``page_size`` tokens of ``key``). ``depth`` is the number of
    tokens from the root to the end of this edge, so a request locked on this node is backed
    by tree pages for exactly its first ``depth`` tokens.

    Reference counts:
        ``holders``  requests that locked this very node.
        ``lock_ref`` holders of this node or of any node below it. A node with
                     ``lock_ref > 0`` is on some running request's path and is never evicted;
                     ``lock_ref == holders + sum(child.lock_ref)`` always.

    A namespace root has ``parent is None``, an empty key and no pages; it is never locked or
    evicted. Nodes compare and hash by identity, so they can sit in sets and heap entries.
    """

    __slots__ = (
        "id",
        "key",
        "pages",
        "children",
        "parent",
        "depth",
        "lock_ref",
        "holders",
        "lease_ref",
        "hits",
        "priority",
        "loaded",
        "last_access",
        "alive",
        "namespace",
        "page_keys",
        "path_hash",
    )

    def __init__(
        self,
        node_id: int,
        key: tuple[int, ...],
        pages: list[int],
        parent: TreeNode | None,
        depth: int,
        last_access: int,
        namespace: Hashable | None = None,
    ) -> None:
        self.id = node_id
        self.key = key
        self.pages = pages
        # Children keyed by their first token (page_size 1) or first page of tokens (a tuple).
        self.children: dict[object, TreeNode] = {}
        self.parent = parent
        self.depth = depth
        self.lock_ref = 0
        self.holders = 0
        # Session leases (memory.leases) whose path passes through this node; like lock_ref,
        # but a leased page stays evictable, only after every unleased one.
        self.lease_ref = 0
        # Eviction policies other than LRU (memory.eviction): matches that passed through this
        # node, and the highest priority of a request whose path it is on.
        self.hits = 1
        self.priority = 0
        # Pages (from L2, from L3) a hierarchical cache loaded into this node and no request
        # has used yet (usage: where cached tokens came from).
        self.loaded = (0, 0)
        self.last_access = last_access
        self.alive = True
        self.namespace = namespace  # only meaningful on roots
        # Prefix-hash key of each page (page_hash), computed on demand by a cache with lower
        # tiers; None until then. Splits and trims keep it aligned with ``pages``.
        self.page_keys: list[bytes] | None = None
        # The chained page key (eviction.shadow.page_keys) at the end of this edge, computed on
        # demand by the miss log (memory.miss_report); None until then, and after a trim.
        self.path_hash: int | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        kind = "root" if self.parent is None else ("leaf" if not self.children else "node")
        return (
            f"TreeNode({kind} id={self.id}, tokens={len(self.key)}, pages={len(self.pages)}, depth={self.depth}, "
            f"lock_ref={self.lock_ref}, holders={self.holders}, lease_ref={self.lease_ref}, "
            f"last_access={self.last_access}, alive={self.alive})"
        )


class MatchResult(NamedTuple):
    """Longest cached, page-aligned prefix of a query.

    ``pages`` back tokens ``[0, matched_len)``; ``node`` ends exactly at ``matched_len`` (the
    namespace root when nothing matched). The caller must :meth:`RadixCache.lock` ``node``
    before anything can evict (any allocation), or the pages may be reused.
    """

    pages: list[int]
    matched_len: int
    node: TreeNode


class CachedPrefix(NamedTuple):
    """What backs a request after :meth:`RadixCache.cache_prefix`.

    ``pages[:cached_len // page_size]`` are tree pages protected by the request's lock on
    ``node``; the rest are the request's private pages (its partial last page, pages
    allocated ahead).
    """

    node: TreeNode
    pages: list[int]
    cached_len: int


class CacheStats(NamedTuple):
    """Monotonic counters: take differences over any window (they survive :meth:`RadixCache.reset`)."""

    queried_tokens: int
    hit_tokens: int
    evicted_pages: int
    inserted_pages: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def common_prefix(edge: tuple[int, ...], key: tuple[int, ...], pos: int, page_size: int) -> int:
    """Tokens that ``edge`` and ``key[pos:]`` share, rounded down to whole pages.

    O(log L) Python steps, O(L) element compares in C (:func:`common_prefix_len`).
    """
    n = common_prefix_len(edge, key, pos)
    return n - n % page_size


def node_page_keys(node: TreeNode, hasher: PrefixHasher) -> list[PageKey]:
    """The prefix-hash key of each page of ``node``, computed once per node (and up its path
    as far as keys are missing), then kept on the node."""
    pending: list[TreeNode] = []
    n = node
    while n.parent is not None and (n.page_keys is None or len(n.page_keys) != len(n.pages)):
        pending.append(n)
        n = n.parent
    if n.parent is None:
        prev = hasher.seed(n.namespace)
    else:
        assert n.page_keys is not None
        prev = n.page_keys[-1]
    for x in reversed(pending):
        x.page_keys = hasher.chain(prev, x.key)
        prev = x.page_keys[-1]
    return node.page_keys or []
