"""Unit tests of the router's prefix tries and worker choice (no processes)."""

from __future__ import annotations

import random

import pytest

from radixserve.prefix import common_prefix_len
from radixserve.serving.dispatch import Dispatcher, PrefixTrie


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


def test_cache_aware_balances_when_imbalanced() -> None:
    d = Dispatcher("cache_aware", balance_abs_threshold=2, balance_rel_threshold=1.0)
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
    s.remove_worker(1)
    assert s.choose([9, 9, 9], {0: 0}, session_id="prog").worker_id == 0


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
