"""Eviction policies of the radix cache and the regret that chooses among them.

::

    policies.py   each policy as an order over evictable leaves (a key that only grows
                  while a node lives, so the lazy heap of lru.EvictableLeaves serves all)
    shadow.py     a flat simulated cache per policy over the stream of page keys, with a
                  bounded ghost list of what it evicted: regret = tokens recomputed within
                  T seconds of their eviction; ``adaptive`` follows the least regret over a
                  window of requests (ARC's ghost lists, generalised to any candidates)
"""

from __future__ import annotations

from radixserve.memory.eviction.policies import (
    CANDIDATES,
    POLICIES,
    policy_key,
)
from radixserve.memory.eviction.shadow import RegretTracker, ShadowCache, page_keys

__all__ = ["CANDIDATES", "POLICIES", "RegretTracker", "ShadowCache", "page_keys", "policy_key"]
