"""KV memory: the paged KV pool, the page allocator, the radix prefix cache, its lower tiers
(L2 host pool, L3 page files) and the memory planner.

The allocator and the radix cache are pure Python and import eagerly; the torch-backed
names (``KVPool``, the planner) load on first access, so ``import radixserve.memory`` stays
cheap for code that only needs the cache (routers, benchmarks of the bookkeeping).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from radixserve.memory.allocator import OutOfPagesError, PageAllocator
from radixserve.memory.no_cache import NoPrefixCache
from radixserve.memory.page_hash import PageKey, PrefixHasher
from radixserve.memory.prefix_cache import PrefixCache
from radixserve.memory.radix_cache import CachedPrefix, CacheStats, MatchResult, RadixCache
from radixserve.memory.tree_node import TreeNode

if TYPE_CHECKING:
    from radixserve.memory.hi_radix_cache import HiRadixCache
    from radixserve.memory.hierarchy import KVHierarchy
    from radixserve.memory.pool import KVPool

_LAZY = {
    "KVPool": "radixserve.memory.pool",
    # The tiers copy tensors: torch-backed, lazy too.
    "HiRadixCache": "radixserve.memory.hi_radix_cache",
    "KVHierarchy": "radixserve.memory.hierarchy",
    # The planner and its byte arithmetic import torch: resolved only when asked for.
    "kv_bytes_per_token": "radixserve.memory.footprint",
    "plan_memory": "radixserve.memory.planner",
    "MemoryPlan": "radixserve.memory.planner",
    "memory_snapshot": "radixserve.memory.snapshot",
    "MemorySnapshot": "radixserve.memory.snapshot",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CacheStats",
    "CachedPrefix",
    "MatchResult",
    "NoPrefixCache",
    "OutOfPagesError",
    "PageAllocator",
    "PageKey",
    "PrefixCache",
    "PrefixHasher",
    "RadixCache",
    "TreeNode",
    # lazy (see _LAZY)
    "HiRadixCache",
    "KVHierarchy",
    "KVPool",
    "MemoryPlan",
    "MemorySnapshot",
    "kv_bytes_per_token",
    "memory_snapshot",
    "plan_memory",
]
