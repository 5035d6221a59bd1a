"""The cache's eviction policy: which order its leaf indexes use, and, for ``adaptive``,
the regret tracker that changes it.

The radix cache owns one :class:`EvictionControl`; the scheduler reports each admitted
request (:meth:`EvictionControl.observe`) and marks a request's priority on its path
(:func:`mark_priority`). A policy switch re-keys the cache's leaf indexes once (O(evictable
leaves)); between switches eviction stays O(log n) per leaf.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from radixserve.memory.eviction.policies import POLICIES, policy_key
from radixserve.memory.eviction.shadow import RegretTracker
from radixserve.memory.tree_node import TreeNode

__all__ = ["EvictionControl", "mark_priority"]


class EvictionControl:
    """Policy ``lru`` | ``lfu`` | ``slru`` | ``priority`` | ``adaptive`` of one cache.

    ``rekey`` re-orders the cache's indexes (None: a cache that evicts nothing)."""

    def __init__(
        self,
        rekey: Callable[[Callable[[TreeNode], Any]], None] | None,
        capacity: int,
        page_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rekey = rekey
        self.capacity = capacity
        self.page_size = page_size
        self.clock = clock
        self.policy = "lru"
        self.active = "lru"  # what the indexes follow now (adaptive's current choice)
        self.key = policy_key("lru")
        self.tracker: RegretTracker | None = None
        # Regret's horizon: a page recomputed this soon after its eviction was evicted too
        # early (the shadows' and the live cache's regret, memory.miss_report).
        self.horizon_s = 120.0

    def set_policy(self, name: str, window: int = 32, horizon_s: float = 120.0) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown eviction policy {name!r}: one of {', '.join(POLICIES)}")
        self.policy = name
        self.horizon_s = horizon_s
        if name == "adaptive" and self._rekey is not None:
            self.tracker = RegretTracker(
                max(1, self.capacity),
                self.page_size,
                window=window,
                horizon_s=horizon_s,
                clock=self.clock,
            )
            self._follow(self.tracker.current)
        else:
            self.tracker = None
            self._follow("lru" if name == "adaptive" else name)

    def _follow(self, name: str) -> None:
        self.active = name
        self.key = policy_key(name)
        if self._rekey is not None:
            self._rekey(self.key)

    def observe(
        self, tokens: Sequence[int], namespace: Hashable | None = None, priority: int = 0
    ) -> None:
        """An admitted request's prompt (only ``adaptive`` looks at it)."""
        if self.tracker is None:
            return
        choice = self.tracker.observe(tokens, namespace, priority)
        if choice != self.active:
            self._follow(choice)

    def flushed(self) -> None:
        """The cache was flushed: so are the shadow caches, ghosts included (what comes
        back after a flush is no policy's regret)."""
        if self.tracker is not None:
            self.tracker.flush()

    def stats(self) -> dict[str, Any]:
        """The policy, what it follows, and each candidate's regret (tokens, monotonic)."""
        t = self.tracker
        return {
            "eviction_policy": self.policy,
            "eviction_policy_active": self.active,
            "eviction_switches_total": t.switches if t is not None else 0,
            "eviction_regret_tokens": dict(t.regret_tokens) if t is not None else {},
        }


def mark_priority(node: TreeNode, priority: int) -> None:
    """Raise the priority of the path root..``node`` to ``priority`` (O(depth); the key of
    the ``priority`` policy only grows, as the lazy heap needs)."""
    while node.parent is not None and node.priority < priority:
        node.priority = priority
        node = node.parent
