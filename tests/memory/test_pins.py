"""Pinned prefixes: never evicted while pinned, refreshed by hits, within a budget, demoted on expiry."""

from __future__ import annotations

from radixserve.memory import KVPool, PageAllocator, RadixCache
from radixserve.memory.hi_radix_cache import HiRadixCache
from radixserve.memory.hierarchy import KVHierarchy

PS = 2
A = list(range(100, 108))  # 4 pages
B = list(range(200, 208))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _put(cache: RadixCache, alloc: PageAllocator, tokens: list[int]) -> None:
    pages = alloc.alloc(len(tokens) // PS)
    cached = cache.insert(tokens, pages)
    alloc.free(pages[: cached // PS])


def _cache(num_pages: int, budget: int) -> tuple[RadixCache, PageAllocator, Clock]:
    alloc = PageAllocator(num_pages)
    cache = RadixCache(alloc, PS)
    clock = Clock()
    cache.pins.budget_pages, cache.pins.clock = budget, clock
    return cache, alloc, clock


def test_a_pinned_prefix_is_never_evicted_until_its_ttl_runs_out() -> None:
    cache, alloc, clock = _cache(8, budget=4)
    _put(cache, alloc, A)
    assert cache.pins.pin(A + [1], None, ttl_s=10.0) == 8
    assert cache.num_evictable_pages == 0 and cache.evict(4) == 0
    cache.check_invariants()
    clock.now = 9.0
    assert cache.pins.expire() == 0
    clock.now = 10.0
    assert cache.pins.expire() == 1
    assert cache.num_evictable_pages == 4 and cache.pins.pinned_pages == 0
    cache.check_invariants()


def test_hits_refresh_the_pin() -> None:
    cache, alloc, clock = _cache(8, budget=4)
    _put(cache, alloc, A)
    cache.pins.pin(A, None, ttl_s=10.0)
    node = cache.match_prefix(A).node
    clock.now = 5.0
    cache.match_prefix(A[:4] + [0])  # a hit on only part of the pinned prefix: no refresh
    assert cache.pins.expiry(node) == 10.0
    clock.now = 8.0
    cache.match_prefix(A + [0, 1, 2])  # a hit through the pinned prefix refreshes it
    assert cache.pins.expiry(node) == 18.0
    clock.now = 17.0
    assert cache.pins.expire() == 0
    assert cache.pins.pin(A, None, ttl_s=30.0) == 8  # pinning again extends (no second lock)
    assert node.holders == 1 and cache.pins.expiry(node) == 47.0


def test_the_budget_bounds_pinned_pages() -> None:
    cache, alloc, _ = _cache(8, budget=5)
    _put(cache, alloc, A)
    _put(cache, alloc, B)
    assert cache.pins.pin(A, None, 5.0) == 8
    assert cache.pins.pin(B, None, 5.0) == 0 and cache.pins.refused == 1  # 4 + 4 > 5
    assert cache.pins.pin(B[:2], None, 5.0) == 2  # one page still fits
    assert cache.pins.pin([1, 2, 3], None, 5.0) == 0  # nothing cached: nothing to pin
    cache.check_invariants()
    cache.reset()  # a flush drops the pins with everything else
    assert len(cache.pins) == 0 and cache.num_cached_pages == 0


def test_an_expired_pin_is_demoted_not_dropped() -> None:
    pool = KVPool(1, 8, PS, 1, 1)
    alloc = PageAllocator(8)
    hier = KVHierarchy(pool, 8)
    cache = HiRadixCache(alloc, PS, hier)
    clock = Clock()
    cache.pins.budget_pages, cache.pins.clock = 8, clock
    _put(cache, alloc, A)
    cache.pins.pin(A, None, 1.0)
    clock.now = 2.0
    cache.pins.expire()
    assert hier.host.num_cached == 4  # in L2 at once, still in L1 too
    assert all(t == {"L1", "L2"} for t in cache.tiers(cache.match_prefix(A).node))
    cache.evict(4)
    assert cache.match_prefix(A).matched_len == 8 and hier.stats.loaded_l2_pages == 4
    cache.check_invariants()
