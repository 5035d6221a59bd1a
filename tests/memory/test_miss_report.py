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


def test_the_live_cache_counts_its_own_policys_regret() -> None:
    """Whatever the policy (not only adaptive's shadows): the pages right after a prompt's
    match that the policy evicted within the horizon are its regret; past the horizon, never
    cached, or flushed, they are not."""
    cache, clock = make(12, page_size=4)
    assert cache.misses is not None
    cache.eviction.set_policy("slru", horizon_s=60.0)
    first = list(range(1, 21))  # 5 pages
    turn(cache, first)
    clock.now += 1.0
    turn(cache, list(range(100, 140)))  # 10 pages: slru evicts 3 of first's tail
    clock.now += 2.0
    m = cache.match_prefix(first)
    assert m.matched_len == 8
    assert cache.misses.regret(first, None, m.node) == 12
    assert cache.misses.stats.as_dict()["cache_regret_tokens"] == {"slru": 12}
    assert cache.misses.regret(list(range(900, 920)), None, None) == 0  # never cached
    clock.now += 100.0  # past the horizon: evicted long enough ago
    assert cache.misses.regret(first, None, m.node) == 0
    clock.now -= 100.0
    cache.reset()  # a flush is no policy's regret
    assert cache.misses.regret(list(range(100, 140)), None, None) == 0
    assert cache.misses.stats.regret == {"slru": 12}


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
    held = cache.num_cached_pages
    assert held <= 16 and len(cache.misses) == 8
    cache.reset()  # the flush's records replace the oldest, within the bound
    assert len(cache.misses) == 8 and cache.misses.stats.flushed_pages == held


def test_every_prompt_is_located_from_its_matched_node() -> None:
    """The cheap per-request count (from the node the match ended at) finds the same
    position as the full walk of an explained report, at page sizes 1 and 4."""
    import random

    for page_size in (1, 4):
        cache, _ = make(4096, page_size)
        assert cache.misses is not None
        rng = random.Random(page_size)
        stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
        for i in range(40):
            stem = rng.choice(stems)
            prompt = stem[: rng.randrange(len(stem) + 1)] + [rng.randrange(50) for _ in range(9)]
            m = cache.match_prefix(prompt[:-1])
            fast = cache.misses.locate(prompt, None, m.node)
            assert fast == cache.misses.locate(prompt, None, None), (page_size, i)
            assert fast.at == cache.misses.explain(prompt).at
            turn(cache, prompt)
        stats = cache.misses.stats
        assert stats.located == 3 * 40 + 40 and stats.reports == 2 * 40  # turn explains too


def test_a_flush_is_its_own_reason_and_no_policys_regret() -> None:
    """A flushed prefix is reported as ``flushed`` (no policy), and under ``adaptive`` what
    the shadows evicted before the flush is not charged as regret when it returns."""
    cache, clock = make(24)
    cache.eviction.clock = clock
    cache.eviction.set_policy("adaptive")
    a, b = list(range(1, 21)), list(range(100, 120))
    for prompt in (a, b):  # the shadows (24 pages) evict most of a: it is in their ghosts
        cache.eviction.observe(prompt)
        turn(cache, prompt)
    cache.reset()
    clock.now += 1.0
    cache.eviction.observe(a)
    d = turn(cache, a)
    assert d.reason == "flushed" and d.policy is None and d.evicted_s_ago == 1.0
    assert d.at == 0 and d.cached_tokens == 0
    assert cache.eviction.tracker is not None
    assert set(cache.eviction.tracker.regret_tokens.values()) == {0}
    stats = cache.misses.stats.as_dict() if cache.misses else {}
    assert stats["cache_flushes_total"] == 1 and stats["cache_miss_reasons"]["flushed"] == 1
