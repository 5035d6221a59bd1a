"""Each eviction policy as the order in which evictable leaves leave.

A policy is a key over a node's counters; the smallest key leaves first. Every key only
grows while a node lives (access time and hit count only rise, priority is a running
maximum), which is what lets one lazily invalidated heap (``lru.EvictableLeaves``) serve
any of them at O(log n) per leaf: a stale entry is smaller than its node's key, so it is
pushed back with the current key when it reaches the top.

==========  ===========================================  ====================================
policy      key (smallest leaves first)                  keeps
==========  ===========================================  ====================================
lru         last access                                  what was used last
lfu         (matches through it, last access)            a hot prefix through a one-off scan
slru        (used twice or more?, last access)           SLRU: probation before protection
priority    (highest request priority on it, last acc.)  high-priority tenants' prefixes
adaptive    one of the above, by measured regret         (shadow.RegretTracker)
==========  ===========================================  ====================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.memory.tree_node import TreeNode

POLICIES = ("lru", "lfu", "slru", "priority", "adaptive")
CANDIDATES = ("lru", "lfu", "slru", "priority")  # what adaptive chooses among


def _lru(n: TreeNode) -> Any:
    return n.last_access


def _lfu(n: TreeNode) -> Any:
    return (n.hits, n.last_access)


def _slru(n: TreeNode) -> Any:
    return (n.hits >= 2, n.last_access)


def _priority(n: TreeNode) -> Any:
    return (n.priority, n.last_access)


_KEYS: dict[str, Callable[[TreeNode], Any]] = {
    "lru": _lru,
    "lfu": _lfu,
    "slru": _slru,
    "priority": _priority,
}


def policy_key(name: str) -> Callable[[TreeNode], Any]:
    """The leaf order of policy ``name`` (one of :data:`CANDIDATES`)."""
    try:
        return _KEYS[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}: one of {', '.join(POLICIES)}"
        ) from None


def item_key(name: str, last: int, hits: int, priority: int) -> Any:
    """The same orders over a shadow cache's items (shadow.ShadowCache)."""
    if name == "lru":
        return last
    if name == "lfu":
        return (hits, last)
    if name == "slru":
        return (hits >= 2, last)
    return (priority, last)
