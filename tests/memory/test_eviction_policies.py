"""Eviction policies on the radix cache (memory.eviction) on hand-made key streams, and the
adaptive policy's regret-driven choice against an offline replay of the same stream."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from radixserve.memory import PageAllocator, RadixCache
from radixserve.memory.eviction import policy_key
from radixserve.memory.eviction.control import mark_priority
from radixserve.memory.eviction.shadow import ShadowCache, replay

Stream = list[tuple[list[int], str | None, int, float]]


def make(policy: str, num_pages: int = 64) -> tuple[RadixCache, list[float]]:
    cache = RadixCache(PageAllocator(num_pages), 1)
    cache.leases.config = type(cache.leases.config)(enabled=False)
    now = [0.0]
    cache.eviction.clock = lambda: now[0]
    cache.eviction.set_policy(policy, window=16)
    return cache, now


def request(cache: RadixCache, tokens: Sequence[int], priority: int = 0) -> int:
    """Admit, compute and finish one request as the scheduler does; returns tokens hit."""
    m = cache.match_prefix(list(tokens[:-1]))
    cache.lock(m.node)
    cache.eviction.observe(tokens, None, priority)
    if priority:
        mark_priority(m.node, priority)
    pages = m.pages + cache.allocator.alloc(len(tokens) - len(m.pages))
    c = cache.cache_prefix(list(tokens), pages, m.node)
    if priority:
        mark_priority(c.node, priority)
    cache.unlock(c.node)
    cache.check_invariants()
    return m.matched_len


HOT = list(range(1, 17))


def scan(i: int, n: int = 40) -> list[int]:
    return list(range(10_000 + i * 100, 10_000 + i * 100 + n))


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru"])
def test_lfu_and_slru_keep_a_hot_prefix_that_lru_drops(policy: str) -> None:
    cache, _ = make(policy)
    for i in range(4):
        request(cache, HOT + [800 + i])  # the hot prefix, used again and again
    for i in range(3):
        request(cache, scan(i))  # a one-off scan of 120 tokens through a 64-page pool
    kept = cache.peek_prefix_len(HOT + [0])
    assert kept == (0 if policy == "lru" else 16)


def test_priority_keeps_a_high_priority_tenants_prefix() -> None:
    for policy, want in (("lru", 0), ("priority", 16)):
        cache, _ = make(policy)
        request(cache, HOT + [900], priority=5)
        for i in range(3):
            request(cache, scan(i))
        assert cache.peek_prefix_len(HOT + [0]) == want, policy


def phases() -> tuple[Stream, int, int]:
    """Warm-up of a hot prefix; then the hot prefix every 3rd request among 40-token scans
    (LFU's stream); then 4 new 14-token prefixes cycling (LRU's: the old hot counts are
    stale). Returns the stream and where the two phases start."""
    out: Stream = []
    t = 0.0
    for i in range(4):
        t += 1
        out.append((HOT + [800 + i], None, 0, t))
    scans_start = len(out)
    for i in range(60):
        t += 1
        out.append((HOT + [900 + i], None, 0, t) if i % 3 == 0 else (scan(i), None, 0, t))
    cycle_start = len(out)
    for i in range(60):
        t += 1
        j = i % 4
        out.append((list(range(50_000 + j * 100, 50_000 + j * 100 + 14)), None, 0, t))
    return out, scans_start, cycle_start


def test_adaptive_switches_within_the_window_and_matches_an_offline_replay() -> None:
    stream, scans_start, cycle_start = phases()
    cache, now = make("adaptive")
    online: list[str] = []
    for tokens, _, prio, t in stream:
        now[0] = t
        request(cache, tokens, prio)
        online.append(cache.eviction.active)
    assert online == replay(stream, 64, 1, window=16)
    assert online[scans_start - 1] == "lru"
    # The hot prefix's first return after a scan costs LRU 16 tokens of regret: LFU at once.
    first_lfu = online.index("lfu")
    assert scans_start <= first_lfu <= scans_start + 3
    assert set(online[first_lfu:cycle_start]) == {"lfu"}
    # The cycle: LFU keeps the stale hot pages and thrashes; back to LRU within the window.
    back = online.index("lru", cycle_start)
    assert back - cycle_start <= 16
    assert set(online[back:]) == {"lru"}
    regret = cache.eviction.stats()["eviction_regret_tokens"]
    assert regret["lru"] > 0 and regret["lfu"] > 0
    assert cache._lru.key is policy_key("lru")  # the tree's index follows the choice


def test_shadow_ghosts_are_bounded_and_regret_needs_a_recent_eviction() -> None:
    sh = ShadowCache("lru", capacity=4, ghosts=3, horizon_s=10.0)
    sh.access([1, 2, 3, 4], 0, 0.0)
    sh.access([5, 6, 7, 8], 0, 1.0)  # evicts 1-4; 3 ghosts kept
    assert len(sh.ghosts) == 3 and len(sh.items) == 4
    assert 4 not in sh.ghosts  # pages are touched suffix first: 4 was the oldest ghost
    hit, regret = sh.access([1, 9], 0, 2.0)  # 1 was evicted 1 s ago: regret; 9 is new
    assert (hit, regret) == (0, 1)
    hit, regret = sh.access([8], 0, 50.0)  # evicted at 2 s, but long ago: no regret
    assert (hit, regret) == (0, 0)


def test_unknown_policy_is_refused() -> None:
    cache, _ = make("lru")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        cache.eviction.set_policy("mru")
