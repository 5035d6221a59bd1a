"""The radix cache's eviction index: its unreferenced leaves, least recently used first
(or in another eviction policy's order: ``key``, see :mod:`radixserve.memory.eviction`).

A set says which nodes are evictable leaves right now; a heap of
``(key(node), node_id, node)`` entries orders them, with lazy invalidation (a policy's key
only ever grows while a node lives: access time, hit count, priority):

* a node that stops being an evictable leaf (locked, got a child, evicted) only leaves the
  set; its heap entries go stale and are dropped when they reach the top;
* a node whose access time was refreshed keeps its old, smaller entry; when that entry
  reaches the top it is pushed back with the current time.

Every evictable leaf always has an entry no newer than its access time, so the first
*fresh* entry at the top is the true least recently used leaf (ties by node id). Each add
and each stale entry costs O(log n) once. The heap is rebuilt from the set when stale
entries outnumber live ones, so it stays O(evictable leaves) and the rebuild is amortized.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

from radixserve.memory.tree_node import TreeNode


def lru_key(node: TreeNode) -> Any:
    return node.last_access


class EvictableLeaves:
    """Unreferenced leaves of a radix tree, ordered by (``key(node)``, node id); LRU by default."""

    __slots__ = ("_set", "_heap", "key")

    def __init__(self, key: Callable[[TreeNode], Any] = lru_key) -> None:
        self._set: set[TreeNode] = set()
        self._heap: list[tuple[Any, int, TreeNode]] = []
        self.key = key

    def __len__(self) -> int:
        return len(self._set)

    def __contains__(self, node: TreeNode) -> bool:
        return node in self._set

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(self._set)

    def add(self, node: TreeNode) -> None:
        """``node`` just became an unreferenced leaf."""
        self._set.add(node)
        heapq.heappush(self._heap, (self.key(node), node.id, node))
        if len(self._heap) > 2 * len(self._set) + 1024:
            self.rekey(self.key)

    def rekey(self, key: Callable[[TreeNode], Any]) -> None:
        """Order by ``key`` from now on (a policy switch): O(n) once."""
        self.key = key
        self._heap = [(key(n), n.id, n) for n in self._set]
        heapq.heapify(self._heap)

    def discard(self, node: TreeNode) -> None:
        """``node`` is no longer an unreferenced leaf (its heap entries go stale)."""
        self._set.discard(node)

    def peek_lru(self) -> TreeNode | None:
        """The least recently used evictable leaf, or None. Drops stale entries on the way."""
        heap, live, key = self._heap, self._set, self.key
        while heap:
            stored, _, node = heap[0]
            if node not in live:
                heapq.heappop(heap)
            elif stored != (now := key(node)):
                heapq.heapreplace(heap, (now, node.id, node))
            else:
                return node
        return None

    def heap_entries(self) -> list[tuple[Any, int, TreeNode]]:
        """The raw heap (for invariant checks)."""
        return list(self._heap)
