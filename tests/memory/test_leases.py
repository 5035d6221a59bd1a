"""Session leases on the radix cache (memory.leases), driven by an injected clock, no sleeps.

Each test plays the scheduler's part by hand: match + lock, allocate, cache_prefix, then
``turn_ended`` before the unlock (what the scheduler does when a turn finishes), and checks
the cache's full invariants after every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from radixserve.memory import KVPool, PageAllocator, RadixCache, TreeNode
from radixserve.memory.hi_radix_cache import HiRadixCache
from radixserve.memory.hierarchy import KVHierarchy
from radixserve.memory.leases import LeaseConfig, quantile


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(num_pages: int, page_size: int = 1, **cfg: float) -> tuple[RadixCache, Clock]:
    alloc = PageAllocator(num_pages)
    cache = RadixCache(alloc, page_size)
    clock = Clock()
    cache.leases.clock = clock
    if cfg:
        cache.leases.config = LeaseConfig(**cfg)  # type: ignore[arg-type]
    return cache, clock


def turn(
    cache: RadixCache,
    tokens: Sequence[int],
    session: str | None,
    ns: str | None = None,
    end: bool = True,
) -> int:
    """One request over ``tokens`` (prompt + answer) from match to finish; returns the tokens
    it found cached. Its path is leased to ``session`` when ``end`` (a stop / tool call)."""
    m = cache.match_prefix(list(tokens[:-1]), ns)
    cache.lock(m.node)
    if session is None:
        session = cache.leases.adopt(tokens, ns)
    if session is not None:
        cache.leases.turn_admitted(session, ns, len(tokens), m.matched_len)
    pages = m.pages + cache.allocator.alloc(len(tokens) // cache.page_size - len(m.pages))
    c = cache.cache_prefix(list(tokens), pages, m.node, ns)
    if end:
        cache.leases.turn_ended(session, ns, c.node)
    cache.unlock(c.node)
    cache.check_invariants()
    return m.matched_len


def churn(cache: RadixCache, start: int, n: int, length: int) -> None:
    """``n`` unrelated single-turn requests of ``length`` tokens each, no session."""
    for i in range(n):
        base = start + i * 1000
        turn(cache, list(range(base, base + length)), None)


def test_paused_session_keeps_its_kv_while_unleased_traffic_fills_the_pool() -> None:
    cache, clock = make(64)
    agent = list(range(1, 21))  # 20 tokens: prompt + answer of turn 1
    turn(cache, agent, "agent")
    assert cache.num_leased_pages == 20
    clock.now += 5.0
    churn(cache, 10_000, 12, 40)  # 480 tokens through a 64-page pool
    assert cache.peek_prefix_len(agent) == 20
    clock.now += 1.0
    found = turn(cache, agent + list(range(500, 510)), "agent")  # turn 2: history + tool result
    assert found == 20
    assert cache.leases.counters.hits == 1 and cache.leases.counters.lost_tokens == 0


def test_lru_alone_loses_the_paused_session() -> None:
    cache, _ = make(64, enabled=False)
    agent = list(range(1, 21))
    turn(cache, agent, "agent")
    churn(cache, 10_000, 12, 40)
    assert cache.peek_prefix_len(agent) == 0
    assert cache.num_leased_pages == 0


def test_lease_length_is_learned_from_each_sessions_own_pauses() -> None:
    cache, clock = make(4096, default_s=30.0, cap_s=600.0)
    assert cache.leases.ttl("fast") == cache.leases.ttl("slow") == 30.0  # before any pause
    for name, pause in (("fast", 2.0), ("slow", 20.0)):
        history = list(range(1, 5)) if name == "fast" else list(range(100, 104))
        for _ in range(5):
            turn(cache, history, name)
            history += [7, 8]
            clock.now += pause  # the tool runs
    fast, slow = cache.leases.ttl("fast"), cache.leases.ttl("slow")
    assert fast == pytest.approx(2.0 * 1.5)
    assert slow == pytest.approx(20.0 * 1.5)
    lease = cache.leases.lease_of("slow")
    assert lease is not None and lease.expires_at - lease.granted_at == pytest.approx(slow)


def test_a_first_lease_lasts_what_every_sessions_pauses_say() -> None:
    """A session that has not paused yet: its lease is the quantile of all sessions' recent
    pauses (x margin), not the fixed default, once ``prior_min`` pauses were seen."""
    cache, clock = make(4096, default_s=30.0, cap_s=600.0, prior_min=2)
    for name in ("a", "b"):  # two agents whose tools take 40 s
        start = 100 if name == "a" else 200
        turn(cache, list(range(start, start + 4)), name)
        clock.now += 40.0
        turn(cache, list(range(start, start + 6)), name)
    assert cache.leases.ttl("newcomer") == pytest.approx(40.0 * 1.5)
    assert cache.leases.ttl("a") == pytest.approx(40.0 * 1.5)  # its own pauses first


def test_a_first_lease_is_rejudged_when_it_runs_out() -> None:
    """Granted before anyone paused (the default), a first lease is kept at its end when
    the pauses seen since say it should last longer; without them it expires as before."""
    cache, clock = make(4096, default_s=30.0, cap_s=600.0, prior_min=1)
    turn(cache, list(range(1, 5)), "early")  # granted now: default 30 s
    turn(cache, list(range(100, 104)), "other")
    clock.now += 25.0
    turn(cache, list(range(100, 106)), "other")  # "other" paused 25 s: prior 37.5 s
    clock.now += 5.0  # "early"'s default lease ends now
    assert cache.leases.expire() == 0
    lease = cache.leases.lease_of("early")
    assert lease is not None and lease.expires_at - lease.granted_at == pytest.approx(37.5)
    clock.now += 7.5
    assert cache.leases.expire() == 1  # other's lease (37.5 s from its refresh) still holds
    assert cache.leases.lease_of("early") is None
    assert cache.leases.lease_of("other") is not None
    cache.check_invariants()


def test_the_cap_bounds_a_lease() -> None:
    cache, clock = make(256, cap_s=10.0)
    turn(cache, [1, 2, 3], "s")
    clock.now += 100.0
    turn(cache, [1, 2, 3, 4, 5], "s")
    assert cache.leases.ttl("s") == 10.0


def test_quantile_is_a_high_rank() -> None:
    assert quantile([1.0, 2.0, 30.0], 0.9) == 30.0
    assert quantile([5.0], 0.9) == 5.0
    assert quantile([float(i) for i in range(1, 11)], 0.9) == 9.0


def test_a_lease_expires_and_its_pages_become_ordinary_cache() -> None:
    cache, clock = make(32, default_s=5.0)
    agent = list(range(1, 11))
    turn(cache, agent, "a")
    assert cache.leases.expire() == 0
    clock.now += 5.0
    assert cache.leases.expire() == 1
    cache.check_invariants()
    assert cache.num_leased_pages == 0 and cache.leases.counters.expired == 1
    assert cache.num_evictable_pages == 10  # still cached, now evictable by LRU
    churn(cache, 10_000, 2, 32)
    assert cache.peek_prefix_len(agent) == 0
    turn(cache, agent + [99], "a")  # the returning turn recomputes its whole history
    assert cache.leases.counters.lost_tokens == 10


def test_leases_yield_oldest_first_then_largest() -> None:
    cache, clock = make(40)
    a, b, c = list(range(1, 11)), list(range(100, 106)), list(range(200, 212))
    turn(cache, a, "a")  # oldest, 10 pages
    clock.now += 1.0
    turn(cache, b, "b")  # same age as c, smaller
    turn(cache, c, "c")  # same age as b, largest: yields before b
    assert cache.num_leased_pages == 28
    cache.evict(12)  # 12 unleased free pages left? none cached unleased: leases must yield
    cache.check_invariants()
    assert cache.peek_prefix_len(a) == 0  # the oldest went first, all 10 of its pages
    assert cache.peek_prefix_len(c) == 10  # then the largest of the younger two: only 2 pages
    assert cache.peek_prefix_len(b) == 6
    assert cache.leases.lease_of("a") is None  # nothing left of it: the lease ended
    kept = cache.leases.lease_of("c")  # lost its tail, holds the rest
    assert kept is not None and kept.tokens == 10
    assert cache.leases.lease_of("b") is not None
    assert cache.leases.counters.yielded == 1 and cache.leases.counters.trimmed_pages == 12


def test_a_trimmed_lease_keeps_the_rest_through_later_traffic() -> None:
    """Pressure takes only what it needs from the oldest lease's tail; the traffic after it
    evicts its own unleased pages, not the rest of that session's context (a lease released
    whole would have been the oldest unleased path, and gone first)."""
    cache, clock = make(48)
    agent = list(range(1, 33))  # 32 tokens leased
    turn(cache, agent, "agent")
    clock.now += 1.0
    big = list(range(1000, 1020))  # 20 tokens at once: 4 more than are free
    m = cache.match_prefix(big)
    cache.lock(m.node)
    pages = cache.allocator.alloc(20)
    assert cache.peek_prefix_len(agent) == 28  # 4 pages from the lease's tail
    c = cache.cache_prefix(big, pages, m.node)
    cache.unlock(c.node)
    churn(cache, 10_000, 6, 12)  # later traffic, within what its own pages free
    cache.check_invariants()
    assert cache.peek_prefix_len(agent) == 28
    lease = cache.leases.lease_of("agent")
    assert lease is not None and lease.tokens == 28
    assert cache.leases.counters.trimmed_pages == 4 and cache.leases.counters.yielded == 0


def test_clock_ties_yield_the_largest_first() -> None:
    cache, _ = make(32)
    turn(cache, list(range(1, 5)), "small")
    turn(cache, list(range(100, 110)), "large")
    cache.evict(3)
    cache.check_invariants()
    large = cache.leases.lease_of("large")  # its tail went, not the small one's
    assert large is not None and large.tokens == 7
    assert cache.peek_prefix_len(list(range(1, 5))) == 4


def test_a_running_request_never_fails_to_allocate_because_of_leases() -> None:
    cache, _ = make(16)
    for i in range(4):
        turn(cache, list(range(i * 100, i * 100 + 4)), f"s{i}")
    assert cache.allocator.num_free == 0 and cache.num_leased_pages == 16
    pages = cache.allocator.alloc(16)  # every leased page yields to a running request
    assert len(pages) == 16 and cache.num_cached_pages == 0
    cache.check_invariants(private_pages=pages)
    cache.allocator.free(pages)


def test_unleased_pages_go_before_any_leased_one() -> None:
    cache, _ = make(30)
    turn(cache, list(range(1, 11)), "agent")
    churn(cache, 10_000, 2, 10)  # 20 unleased pages, recently used
    cache.evict(20)
    cache.check_invariants()
    assert cache.peek_prefix_len(list(range(1, 11))) == 10
    assert cache.leases.counters.yielded == 0


def test_next_turn_refreshes_the_lease_and_session_close_releases_it() -> None:
    cache, clock = make(64, default_s=10.0)
    turn(cache, list(range(1, 9)), "s")
    first = cache.leases.lease_of("s")
    clock.now += 8.0
    turn(cache, list(range(1, 13)), "s")  # turn 2 extends the history
    second = cache.leases.lease_of("s")
    assert first is not None and second is not None and not first.alive
    assert second.tokens == 12 and second.expires_at > first.expires_at
    assert cache.num_leased_pages == 12
    assert cache.leases.release("s")
    cache.check_invariants()
    assert cache.num_leased_pages == 0 and cache.leases.lease_of("s") is None


def test_a_chat_without_a_key_is_adopted_from_the_tree() -> None:
    cache, _ = make(64)
    history = list(range(1, 11))
    turn(cache, history, None)  # turn 1: no key, no lease yet
    assert cache.num_leased_pages == 0
    turn(cache, list(range(1, 6)) + [77, 78], None)  # another request sharing only a prefix
    assert cache.num_leased_pages == 0
    turn(cache, history + [50, 51, 52], None)  # re-sends turn 1's prompt + answer: adopted
    assert cache.num_leased_pages == 13 and cache.leases.counters.adopted == 1
    churn(cache, 10_000, 4, 30)
    assert cache.peek_prefix_len(history + [50, 51, 52]) == 13


def test_leases_stay_in_their_tenants_namespace() -> None:
    cache, _ = make(48)
    same = list(range(1, 11))
    turn(cache, same, "s", ns="tenant-a")
    turn(cache, same, "s", ns="tenant-b")  # same tokens and id, another tenant: its own lease
    assert cache.num_leased_pages == 20
    assert cache.leases.lease_of("s", "tenant-a") is not cache.leases.lease_of("s", "tenant-b")
    assert cache.leases.lease_of("s") is None  # the default namespace has no such session
    assert cache.leases.release("s", "tenant-a")
    cache.check_invariants()
    assert cache.num_leased_pages == 10
    churn(cache, 10_000, 2, 20)
    assert cache.peek_prefix_len(same, "tenant-a") == 0
    assert cache.peek_prefix_len(same, "tenant-b") == 10


def test_a_split_leased_edge_keeps_the_lease_on_both_parts() -> None:
    cache, _ = make(64, page_size=2)
    turn(cache, list(range(1, 13)), "s")
    turn(cache, list(range(1, 7)) + [90, 91, 92], None)  # splits the leased edge at 6
    cache.check_invariants()
    assert cache.num_leased_pages == 6
    churn(cache, 10_000, 3, 20)
    assert cache.peek_prefix_len(list(range(1, 13))) == 12


def test_hierarchical_cache_demotes_a_yielded_lease_to_l2() -> None:
    ps, l1 = 2, 12
    alloc = PageAllocator(l1)
    pool = KVPool(1, l1, ps, 1, 1)
    flat = pool.k_data[0].view(-1)
    cache = HiRadixCache(alloc, ps, KVHierarchy(pool, 64, None, "lease-test"))
    agent = list(range(1, 13))  # 6 pages
    m = cache.match_prefix(agent[:-1])
    cache.lock(m.node)
    pages = alloc.alloc(6)
    flat[torch.tensor([p * ps + i for p in pages for i in range(ps)])] = torch.tensor(
        agent, dtype=torch.float32
    )
    c = cache.cache_prefix(agent, pages, m.node)
    cache.leases.turn_ended("a", None, c.node)
    cache.unlock(c.node)
    held = alloc.alloc(l1)  # a running request takes all of L1: the lease yields, L2 keeps it
    cache.check_invariants(private_pages=held)
    assert cache.num_cached_pages == 0 and cache.leases.counters.yielded == 1
    alloc.free(held)
    m = cache.match_prefix(agent + [0])
    assert m.matched_len == 12  # loaded back from L2
    got = flat[torch.tensor([p * ps + i for p in m.pages for i in range(ps)])]
    assert [int(x) for x in got.tolist()] == agent


def _leaf_count(cache: RadixCache) -> int:
    return sum(1 for n in cache.nodes() if isinstance(n, TreeNode) and not n.children)


def test_eviction_does_not_scan_leased_leaves() -> None:
    """Evicting unleased pages with many leases alive visits no leased leaf (second index)."""
    cache, _ = make(2000)
    for i in range(150):
        turn(cache, [i * 10 + 1, i * 10 + 2, i * 10 + 3, i * 10 + 4], f"s{i}")
    churn(cache, 100_000, 20, 50)
    assert len(cache._leased_lru) == 150 and _leaf_count(cache) >= 150
    leased_heap = cache._leased_lru.heap_entries()
    cache.evict(100)  # the two oldest churn leaves
    assert cache._leased_lru.heap_entries() == leased_heap  # the leased index was not visited
    assert cache.leases.counters.yielded == 0
    assert cache.peek_prefix_len(list(range(100_000, 100_050))) == 0
    assert cache.peek_prefix_len(list(range(101_000, 101_050))) == 0
    assert cache.peek_prefix_len(list(range(102_000, 102_050))) == 50
