"""Miss reports (memory.miss_report): where a prompt left the longest cached path and why,
on a real radix cache with an injected clock; each test plays the scheduler's part by hand
(match + lock, allocate, cache_prefix, lease at the turn's end, unlock)."""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.memory import PageAllocator, RadixCache
from radixserve.memory.leases import LeaseConfig
from radixserve.memory.miss_report import Divergence


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(num_pages: int, page_size: int = 1) -> tuple[RadixCache, Clock]:
    cache = RadixCache(PageAllocator(num_pages), page_size)
    clock = Clock()
    cache.leases.clock = clock
    assert cache.misses is not None
    cache.misses.clock = clock
    return cache, clock


def turn(
    cache: RadixCache, tokens: Sequence[int], session: str | None = None, ns: str | None = None
) -> Divergence:
    """One request over ``tokens`` (prompt + answer), explained at admission as the scheduler
    does; its path is leased to ``session`` at its end."""
    assert cache.misses is not None
    m = cache.match_prefix(list(tokens[:-1]), ns)
    cache.lock(m.node)
    lost = cache.leases.lost(session, ns) if session else None
    report = cache.misses.explain(tokens, ns, lost)
    if session is not None:
        cache.leases.turn_admitted(session, ns, len(tokens), m.matched_len)
    pages = m.pages + cache.allocator.alloc(len(tokens) // cache.page_size - len(m.pages))
    c = cache.cache_prefix(list(tokens), pages, m.node, ns)
    if session is not None:
        cache.leases.turn_ended(session, ns, c.node)
    cache.unlock(c.node)
    cache.check_invariants()
    return report


def test_a_drifting_system_prompt_diverges_at_its_timestamp() -> None:
    """A timestamp at token 37 of the system prompt: every request after the first diverges
    there, whatever its page size, and the top divergence position says so."""
    for page_size in (1, 4):
        cache, _ = make(512, page_size)
        sys_head, sys_tail = list(range(1000, 1037)), list(range(2000, 2030))
        for minute in range(6):
            stamp = [3000 + minute, 3100 + minute]  # "12:0<minute>"
            question = [4000 + 10 * minute + i for i in range(9)]
            d = turn(cache, sys_head + stamp + sys_tail + question)
            if minute == 0:
                assert d.reason == "never_cached" and d.at == 0
                continue
            assert d.at == 37 and d.reason == "never_cached"
            assert d.cached_tokens == 37 // page_size * page_size
            assert d.before == sys_head[-4:] and d.after == stamp + sys_tail[:2]
            assert d.cached_after[:2] == [3000 + minute - 1, 3100 + minute - 1]
        assert cache.misses is not None
        top = cache.misses.stats.top(3)
        assert top[0]["index"] == 37 and top[0]["count"] == 5
        stats = cache.misses.stats.as_dict()
        assert stats["cache_reports_total"] == 6
        buckets = stats["cache_divergence_buckets"]  # cumulative, as Prometheus's le
        assert (buckets["0"], buckets["16"], buckets["64"], buckets["+Inf"]) == (1, 1, 6, 6)


def test_an_evicted_prefix_names_the_policy_and_when() -> None:
    cache, clock = make(32)
    first = list(range(1, 21))
    turn(cache, first)
    clock.now += 5.0
    turn(cache, list(range(100, 130)))  # 30 new tokens: evicts 18 of the first request's
    clock.now += 2.0
    d = turn(cache, first)
    assert d.reason == "evicted" and d.policy == "lru" and d.evicted_s_ago == 2.0
    assert d.at == d.cached_tokens < 20


def test_a_lost_lease_is_named_as_the_reason() -> None:
    cache, clock = make(40)
    cache.leases.config = LeaseConfig(default_s=3.0, min_s=1.0, cap_s=10.0)
    history = list(range(1, 21))
    turn(cache, history, session="agent")
    clock.now += 4.0  # past the 3 s lease
    cache.leases.expire()
    turn(cache, list(range(100, 130)))  # churn evicts the unleased history
    d = turn(cache, history + [77, 78], session="agent")
    assert d.reason == "lease_expired" and d.policy == "lru"
    assert cache.leases.counters.expired == 1


def test_another_namespace_and_a_fully_cached_prompt() -> None:
    cache, _ = make(64)
    prompt = list(range(1, 21))
    turn(cache, prompt, ns="tenant-a")
    d = turn(cache, prompt, ns="tenant-b")
    assert d.reason == "other_namespace" and d.at == 0
    again = turn(cache, prompt, ns="tenant-b")
    assert again.reason == "fully_cached" and again.at is None
    assert again.cached_tokens == 20


def test_eviction_records_are_bounded() -> None:
    cache, _ = make(16)
    assert cache.misses is not None
    cache.misses.max_records = 8
    for i in range(10):
        turn(cache, list(range(100 * i, 100 * i + 12)))
    assert cache.num_cached_pages <= 16 and len(cache.misses) == 8
    cache.reset()
    assert len(cache.misses) == 0
