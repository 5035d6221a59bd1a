"""Unit tests of the router's prefix tries and worker choice (no processes)."""

from __future__ import annotations

import random

import pytest

from radixserve.prefix import common_prefix_len
from radixserve.serving.router.dispatch import Dispatcher, Outstanding, PrefixTrie


def test_common_prefix_len_matches_naive() -> None:
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(0, 12)
        a = tuple(rng.randint(0, 2) for _ in range(n))
        b = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 12)))
        naive = 0
        while naive < min(len(a), len(b)) and a[naive] == b[naive]:
            naive += 1
        assert common_prefix_len(a, b) == naive


def test_common_prefix_len_long_runs_and_offsets() -> None:
    """Past the first gallop step (64) and from an offset into ``b``, against a plain loop."""
    rng = random.Random(1)
    for _ in range(300):
        shared = [rng.randint(0, 9) for _ in range(rng.randint(0, 700))]
        a = tuple(shared + [rng.randint(0, 9) for _ in range(rng.randint(0, 40))])
        start = rng.randint(0, 30)
        b = tuple([7] * start + shared + [rng.randint(0, 9) for _ in range(rng.randint(0, 40))])
        naive = 0
        while naive < min(len(a), len(b) - start) and a[naive] == b[start + naive]:
            naive += 1
        assert common_prefix_len(a, b, start) == naive
    assert common_prefix_len((1, 2), (1, 2), 5) == 0  # an offset past the end
    assert common_prefix_len([1, 2, 3], (1, 2, 4)) == 2  # a list and a tuple compare by value


def test_trie_match_insert_against_reference() -> None:
    rng = random.Random(1)
    trie = PrefixTrie(max_tokens=10**9)
    inserted: list[tuple[int, ...]] = []
    for _ in range(300):
        seq = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 10)))
        if rng.random() < 0.5:
            trie.insert(seq)
            inserted.append(seq)
        expected = max((common_prefix_len(seq, s) for s in inserted), default=0)
        assert trie.match(seq) == expected
    # Stored tokens == sum of edge lengths == number of distinct non-empty prefixes.
    distinct = {s[:i] for s in inserted for i in range(1, len(s) + 1)}
    assert trie.num_tokens == len(distinct)


def test_trie_lru_cap_drops_oldest() -> None:
    trie = PrefixTrie(max_tokens=100)
    old = list(range(1000, 1040))
    trie.insert(old)
    for i in range(5):
        trie.insert([i] * 20)
    trie.match([4] * 20)
    assert trie.num_tokens <= 100
    assert trie.match(old) == 0  # the least recently used went first
    assert trie.match([4] * 20) == 20


def test_cache_aware_routes_shared_prefix_to_one_worker() -> None:
    d = Dispatcher("cache_aware", balance_abs_threshold=100)
    loads = {0: 0, 1: 0}
    system_a = list(range(100, 164))
    system_b = list(range(200, 264))
    first_a = d.choose(system_a + [1, 2], loads)
    first_b = d.choose(system_b + [1, 2], loads)
    assert first_a.worker_id != first_b.worker_id  # fresh prefixes spread
    for q in range(10):
        assert d.choose(system_a + [q, q + 1], loads).worker_id == first_a.worker_id
        assert d.choose(system_b + [q, q + 1], loads).worker_id == first_b.worker_id


def test_cache_aware_balances_when_imbalanced_in_requests() -> None:
    d = Dispatcher(
        "cache_aware", balance_load="requests", balance_abs_threshold=2, balance_rel_threshold=1.0
    )
    prefix = list(range(64))
    w = d.choose(prefix + [0], {0: 0, 1: 0}).worker_id
    other = 1 - w
    assert d.choose(prefix + [1], {w: 2, other: 0}).reason == "cache"
    dec = d.choose(prefix + [2], {w: 3, other: 0})
    assert dec.worker_id == other and dec.reason == "balance"


def test_round_robin_and_sessions() -> None:
    d = Dispatcher("round_robin")
    loads = {0: 0, 1: 0, 2: 0}
    assert [d.choose([i], loads).worker_id for i in range(6)] == [0, 1, 2, 0, 1, 2]
    s = Dispatcher("cache_aware")
    wid = s.choose([1, 2, 3], {0: 5, 1: 0}, session_id="prog").worker_id
    assert wid == 1
    assert s.choose([9, 9, 9], {0: 0, 1: 50}, session_id="prog") == (1, 0, "session")
    # Overloaded beyond both balance thresholds (2048 work units, 1.5x): the session moves.
    moved = s.choose([9, 9, 9], {0: 0, 1: 5000}, session_id="prog")
    assert moved.worker_id == 0 and moved.reason != "session"
    assert s.choose([9, 9, 9], {0: 40, 1: 0}, session_id="prog") == (0, 3, "session")
    s.remove_worker(0)
    assert s.choose([9, 9, 9], {1: 0}, session_id="prog").worker_id == 1


def test_sessions_are_per_tenant_namespace() -> None:
    """Two tenants using the same session id keep their own workers, and closing one
    tenant's session forgets only its route."""
    d = Dispatcher("cache_aware")
    a = d.choose([1, 2, 3], {0: 0, 1: 50}, session_id="s", namespace="tenant-a").worker_id
    b = d.choose([4, 5, 6], {0: 50, 1: 0}, session_id="s", namespace="tenant-b").worker_id
    assert (a, b) == (0, 1)
    assert d.choose([7], {0: 40, 1: 0}, session_id="s", namespace="tenant-a").reason == "session"
    assert d.choose([7], {0: 0, 1: 40}, session_id="s", namespace="tenant-b").worker_id == 1
    d.forget_session("s", "tenant-a")
    assert d.choose([8], {0: 40, 1: 0}, session_id="s", namespace="tenant-a").reason != "session"
    assert d.choose([8], {0: 0, 1: 40}, session_id="s", namespace="tenant-b").reason == "session"


def test_errors() -> None:
    with pytest.raises(ValueError):
        Dispatcher("nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Dispatcher().choose([1], {})


def test_namespaces_do_not_share_prefixes() -> None:
    d = Dispatcher("cache_aware", balance_abs_threshold=100)
    loads = {0: 0, 1: 0}
    prefix = list(range(64))
    w = d.choose(prefix + [1], loads, namespace="tenant-a").worker_id
    assert d.choose(prefix + [2], loads, namespace="tenant-a") == (w, 64, "cache")
    other = d.choose(prefix + [3], loads, namespace="tenant-b")
    assert other.reason == "least_loaded" and other.matched_tokens == 0
    assert d.choose(prefix + [4], loads).matched_tokens == 0  # no namespace: its own space too


# --------------------------------------------------------------------------- prefix groups

SYSTEM = list(range(1000, 2000))  # a 1,000-token shared system prompt


def test_group_stays_under_small_imbalance_moves_under_real_one() -> None:
    """Work is measured in prompt tokens: a few more short requests are no reason to
    recompute a 1,000-token prefix elsewhere; a backlog of real prefill work is."""
    d = Dispatcher("cache_aware")
    w = d.choose(SYSTEM + [1], {0: 0, 1: 0}).worker_id
    other = 1 - w
    # 12 vs 4 requests in flight (SGLang-style counts would call this imbalanced), their
    # suffixes queued: 12*32 + 300 tokens vs 4*32.
    small = {w: Outstanding(12, 300), other: Outstanding(4, 0)}
    assert d.choose(SYSTEM + [2], small) == (w, 1000, "cache")
    assert not d.imbalanced(d.load(small[w]), d.load(small[other]))
    # Three new 1,000-token groups queued there: the other worker wins.
    real = {w: Outstanding(12, 3300), other: Outstanding(4, 0)}
    dec = d.choose(SYSTEM + [3], real)
    assert dec.worker_id == other and dec.reason == "balance"
    # Both thresholds must hold: a large absolute gap that is relatively small stays.
    big = {w: Outstanding(100, 9000), other: Outstanding(90, 8000)}
    assert d.choose(SYSTEM + [4], big).reason == "cache"


def test_request_count_mode_spills_a_hot_group() -> None:
    """The previous measure (requests in flight, gap 4): the same small imbalance moves it."""
    d = Dispatcher("cache_aware", balance_load="requests", balance_abs_threshold=4)
    w = d.choose(SYSTEM + [1], {0: 0, 1: 0}).worker_id
    dec = d.choose(SYSTEM + [2], {w: Outstanding(12, 300), 1 - w: Outstanding(4, 0)})
    assert dec == (1 - w, 0, "balance")


def test_in_flight_prefix_is_followed_until_prefilled() -> None:
    d = Dispatcher("cache_aware")
    w = d.choose(SYSTEM + [1], {0: 0, 1: 0}, rid="a").worker_id
    other = 1 - w
    heavy = {w: Outstanding(20, 6000), other: Outstanding(0, 0)}  # really imbalanced
    assert d.choose(SYSTEM + [2], heavy, rid="b") == (w, 1000, "in_flight")
    d.prefilled("b")  # a follower's first token: the prefix is computed there now
    assert d.tries[w].lookup(SYSTEM + [3]) == (1000, False)
    assert d.choose(SYSTEM + [3], heavy, rid="c").reason == "balance"
    d.prefilled("a")
    d.ended("a")  # idempotent after prefilled
    # A group whose only request ended before its prefill is not in flight any more.
    other_system = list(range(5000, 5100))
    w2 = d.choose(other_system + [1], {0: 0, 1: 0}, rid="d").worker_id
    assert d.tries[w2].lookup(other_system + [2]).in_flight
    d.ended("d")
    assert d.tries[w2].lookup(other_system + [2]) == (100, False)
    # follow_in_flight=False: balance wins even while in flight.
    off = Dispatcher("cache_aware", follow_in_flight=False)
    w3 = off.choose(SYSTEM + [1], {0: 0, 1: 0}, rid="x").worker_id
    assert off.choose(SYSTEM + [2], {w3: Outstanding(20, 6000), 1 - w3: 0}).reason == "balance"


def test_retry_and_dead_worker_forget_pending_prefixes() -> None:
    d = Dispatcher("cache_aware")
    w = d.choose(SYSTEM + [1], {0: 0, 1: 0}, rid="a").worker_id
    d.remove_worker(w)  # its worker died; the router retries it on the other one
    dec = d.choose(SYSTEM + [1], {1 - w: 0}, rid="a")
    assert dec.worker_id == 1 - w and d.tries[dec.worker_id].lookup(SYSTEM).in_flight
    d.prefilled("a")
    assert not d.tries[dec.worker_id].lookup(SYSTEM).in_flight


def test_in_flight_is_per_namespace() -> None:
    """Tenants' salted namespaces keep separate trees: one tenant's prefix in flight (or
    cached) on a worker draws none of another tenant's requests."""
    d = Dispatcher("cache_aware")
    w = d.choose(SYSTEM + [1], {0: 0, 1: 0}, namespace="t1", rid="a").worker_id
    busy = {w: Outstanding(1, 1000), 1 - w: Outstanding(0, 0)}
    assert d.choose(SYSTEM + [2], busy, namespace="t1") == (w, 1000, "in_flight")
    dec = d.choose(SYSTEM + [3], busy, namespace="t2")
    assert dec == (1 - w, 0, "least_loaded")
    assert d.choose(SYSTEM + [4], busy).matched_tokens == 0  # no namespace: its own space


def test_trie_in_flight_survives_splits_and_eviction() -> None:
    trie = PrefixTrie(max_tokens=40)
    trie.insert([1] * 10 + [2] * 10, pending=True)
    trie.insert([1] * 10 + [3] * 10, pending=True)  # splits the first edge after 10 tokens
    assert trie.lookup([1] * 10 + [4]) == (10, True)
    trie.prefilled([1] * 10 + [3] * 10)
    assert trie.lookup([1] * 10 + [4]) == (10, False)  # the shared part is computed
    assert trie.lookup([1] * 10 + [2] * 3) == (13, True)  # the other branch is not
    trie.insert([9] * 30)  # over the cap: the LRU leaf goes, unless it is in flight
    assert trie.num_tokens <= 40 + 30
    assert trie.lookup([1] * 10 + [2] * 10) == (20, True)
    trie.abandon([1] * 10 + [2] * 10)
    trie.insert([8] * 30)
    assert trie.lookup([1] * 10 + [2] * 10).tokens < 20  # evictable again


def _simulate(d: Dispatcher, seed: int = 0) -> dict[int, set[int]]:
    """64 chats under 4 shared 1,000-token system prompts, shuffled, 16 in flight, two
    workers that each prefill one queued request per step and decode 8 steps: which
    workers computed each system prompt."""
    rng = random.Random(seed)
    reqs = [(g, q) for g in range(4) for q in range(16)]
    rng.shuffle(reqs)
    queued: dict[int, list[tuple[str, int, int]]] = {0: [], 1: []}  # rid, group, uncached
    running: dict[int, list[tuple[str, int]]] = {0: [], 1: []}  # rid, steps left
    computed: dict[int, set[int]] = {0: set(), 1: set()}
    nxt = 0
    while nxt < len(reqs) or any(queued.values()) or any(running.values()):
        while nxt < len(reqs) and sum(len(queued[w]) + len(running[w]) for w in (0, 1)) < 16:
            g, q = reqs[nxt]
            rid = f"{g}.{q}"
            loads = {
                w: Outstanding(len(queued[w]) + len(running[w]), sum(u for _, _, u in queued[w]))
                for w in (0, 1)
            }
            dec = d.choose([*range(g * 1000, g * 1000 + 1000), 10**6 + nxt], loads, rid=rid)
            queued[dec.worker_id].append((rid, g, 1001 - dec.matched_tokens))
            nxt += 1
        for w in (0, 1):
            running[w] = [(r, left - 1) for r, left in running[w] if left > 1]
            if queued[w]:
                rid, g, _ = queued[w].pop(0)
                computed[w].add(g)
                d.prefilled(rid)
                running[w].append((rid, 8))
    return {g: {w for w in (0, 1) if g in computed[w]} for g in range(4)}


def test_prefix_groups_stay_together_in_a_simulated_run() -> None:
    """The benchmark's workload, simulated: the work-measured policy computes every system
    prompt on one worker; counting requests with a gap of 4 computes some on both."""
    for seed in range(3):
        groups = _simulate(Dispatcher("cache_aware"), seed)
        assert all(len(ws) == 1 for ws in groups.values()), groups
        assert set().union(*groups.values()) == {0, 1}  # and both workers are used
    old = [
        _simulate(
            Dispatcher(
                "cache_aware",
                balance_load="requests",
                balance_abs_threshold=4,
                follow_in_flight=False,
            ),
            seed,
        )
        for seed in range(3)
    ]
    assert any(len(ws) == 2 for groups in old for ws in groups.values())
