"""The window pool's accounting and the sliding-window radix cache on their own, no model
(memory.window_pool, memory.swa_cache): every operation followed by the full invariant
check (free + evictable + in use == window pages, wref equal to the locks' windows)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.memory.swa_cache import SWARadixCache
from radixserve.memory.window_pool import WindowedPageAllocator, WindowPages, first_window_page

PS, WINDOW = 4, 8


def _cache(num_pages: int = 40, window_pages: int = 12) -> SWARadixCache:
    return SWARadixCache(
        WindowedPageAllocator(num_pages, WindowPages(num_pages, window_pages, WINDOW, PS)), PS
    )


def _insert(cache: SWARadixCache, tokens: list[int]) -> list[int]:
    """A request computes ``tokens`` from scratch and finishes: returns the tree's pages."""
    m = cache.match_prefix(tokens)
    cache.lock(m.node)
    pages = m.pages + cache.allocator.alloc(len(tokens) // PS - len(m.pages))
    res = cache.cache_prefix(tokens, pages, m.node)
    cache.check_invariants()
    cache.unlock(res.node)
    cache.check_invariants()
    return res.pages


def test_first_window_page() -> None:
    # A row at 12 sees 5..12: page 1 (4..7) on; a row at 7 sees 0..7.
    assert first_window_page(12, WINDOW, PS) == 1
    assert first_window_page(7, WINDOW, PS) == 0


def test_lock_holds_the_last_window_and_unlock_makes_it_evictable() -> None:
    cache = _cache()
    w = cache.window
    pages = _insert(cache, list(range(100, 140)))  # 10 pages, all mapped, none referenced
    assert w.num_evictable == 10 and cache.num_window_in_use == 0
    m = cache.match_prefix(list(range(100, 140)) + [1])
    assert m.matched_len == 40
    cache.lock(m.node)  # the last window of 40 tokens: pages 8 and 9
    assert [w.wref[g] for g in pages] == [0] * 8 + [1, 1]
    assert w.num_evictable == 8 and cache.num_window_in_use == 2
    cache.check_invariants()
    cache.unlock(m.node)
    assert w.num_evictable == 10
    cache.check_invariants()


def test_pressure_tombstones_leading_pages_and_the_match_is_cut_back() -> None:
    cache = _cache()
    w = cache.window
    a = list(range(100, 140))
    pages = _insert(cache, a)
    taken = cache.allocator.alloc(8)  # 2 window pages free, 6 taken from a's node
    cache.check_invariants(taken)
    assert cache.window_evicted_pages == 6
    assert [w.table[g] >= 0 for g in pages] == [False] * 6 + [True] * 4
    assert cache.match_prefix(a + [1]).matched_len == 40  # its last window is still whole
    assert cache.match_prefix(a[:24] + [1]).matched_len == 0  # pages 4, 5 are gone
    assert cache.window_cut_tokens == 24
    cache.allocator.free(taken)
    cache.check_invariants()


def test_a_tombstoned_tail_cuts_the_match_back_to_a_whole_window() -> None:
    cache = _cache()
    w = cache.window
    a = list(range(100, 140))
    pages = _insert(cache, a)
    _insert(cache, a[:24] + list(range(200, 216)))  # a's [24, 40) is now the LRU node
    taken = w.allocator.alloc(w.allocator.num_free + 2)  # a's pages 6, 7 went for b: 8, 9 now
    w.allocator.free(taken)
    cache.check_invariants()
    assert [w.table[g] >= 0 for g in pages] == [True] * 6 + [False] * 4
    m = cache.match_prefix(a + [1])
    assert m.matched_len == 24 and m.node.depth == 24 and cache.window_cut_tokens == 16
    assert cache.total_cached_tokens == 56  # the global pages are all still there
    cache.check_invariants()


def test_peek_is_cut_back_as_the_match_is_and_lpm_ranks_by_it() -> None:
    """A scoring peek sees the hit the request will get: a 40-token prefix whose last window
    is tombstoned peeks as 24 (not the 40 its global pages hold), without touching the tree,
    so LPM ranks a whole 32-token hit before it."""
    from radixserve.sampling_params import SamplingParams
    from radixserve.scheduling.policy import LPMPolicy
    from radixserve.scheduling.request import Request

    cache = _cache(num_pages=40, window_pages=24)
    w = cache.window
    a, c = list(range(100, 140)), list(range(300, 332))
    pages = _insert(cache, a)
    _insert(cache, a[:24] + list(range(200, 216)))
    _insert(cache, c)
    for g in pages[6:]:  # a's tail [24, 40) tombstoned, as window-pool pressure does
        w.allocator.free([w.unmap(g)])
        w.num_evictable -= 1
    cache.check_invariants()
    before = (cache.stats, [n.last_access for n in cache.nodes()])
    assert cache.peek_prefix_len(a + [1]) == 24 and cache.peek_prefix_len(c + [1]) == 32
    assert (cache.stats, [n.last_access for n in cache.nodes()]) == before  # untouched
    reqs = []
    for i, prompt in enumerate([a + [1, 2], c + [1, 2]]):
        r = Request(f"r{i}", prompt, len(prompt), SamplingParams(), 1000)
        r.arrival_step = i
        reqs.append(r)
    assert [r.request_id for r in LPMPolicy(cache).order(reqs, 0)] == ["r1", "r0"]
    assert cache.match_prefix(a + [1]).matched_len == 24
    assert cache.match_prefix(c + [1]).matched_len == 32
    cache.check_invariants()


def test_recompute_hands_window_pages_to_the_trees_tombstones() -> None:
    cache = _cache()
    w = cache.window
    a = list(range(100, 124))
    pages = _insert(cache, a)
    w.allocator.free(w.allocator.alloc(w.allocator.num_free + w.num_evictable))
    assert all(w.table[g] < 0 for g in pages)
    assert cache.match_prefix(a + [1]).matched_len == 0
    mine = _insert(cache, a)  # computed again: the tree keeps its pages, gets our window pages
    assert mine == pages
    lo = first_window_page(24, WINDOW, PS)
    assert [w.table[g] >= 0 for g in pages] == [False] * lo + [True] * (6 - lo)
    assert cache.match_prefix(a + [1]).matched_len == 24


@settings(max_examples=25, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_random_requests_keep_every_invariant(rng: random.Random) -> None:
    """Requests that share prefixes, advance chunk by chunk and drop their private window
    pages as they go, under both pools' pressure, in random order (Hypothesis draws the
    random streams)."""
    cache = _cache(num_pages=64, window_pages=20)
    alloc, w = cache.allocator, cache.window
    prefixes = [[rng.randrange(3, 50) for _ in range(20)] for _ in range(3)]
    for _ in range(30):
        tokens = rng.choice(prefixes)[: rng.randrange(4, 21)] + [
            rng.randrange(3, 50) for _ in range(rng.randrange(1, 30))
        ]
        peeked = cache.peek_prefix_len(tokens)
        m = cache.match_prefix(tokens)
        assert m.matched_len == peeked  # scoring sees the hit admission gets
        cache.lock(m.node)
        node, pages, done, window_lo = m.node, list(m.pages), m.matched_len, 0
        try:
            while done < len(tokens):
                done = min(len(tokens), done + rng.randrange(1, 9))
                pages += alloc.alloc(-(-done // PS) - len(pages))
                node, pages, cached = cache.cache_prefix(tokens[:done], pages, node)
                lo = max(cached // PS, window_lo)
                hi = first_window_page(done, WINDOW, PS)
                if hi > lo:
                    w.release_private(pages[lo:hi], None)
                    window_lo = hi
                cache.check_invariants(pages[cached // PS :])
        except Exception as e:  # out of pages: give everything back, as a retraction does
            assert type(e).__name__ == "OutOfPagesError", e
        c = cache.cache_prefix(tokens[: min(done, len(pages) * PS)], pages, node)
        cache.unlock(c.node)
        alloc.free(c.pages[c.cached_len // PS :])
        cache.check_invariants()
        if rng.random() < 0.2:
            cache.evict(rng.randrange(1, 8))
            cache.check_invariants()


@pytest.mark.parametrize("staged", [False, True])
def test_l2_carries_window_kv_and_loads_tombstones_where_it_was_gone(staged: bool) -> None:
    """The hierarchical cache over a window pool (memory.window_host, memory.swa_hi_cache):
    a page demoted with its window page comes back with its window layer's KV, one demoted
    as a tombstone comes back as one, and the hit is cut back where a window is incomplete.
    Pages hold their own token ids in both layers (layer 0 global, layer 1 windowed).
    ``staged``: through the pinned-staging copies CUDA uses (deferred host scatters)."""
    import torch

    from radixserve.memory import KVPool
    from radixserve.memory.hierarchy import KVHierarchy
    from radixserve.memory.host_pool import PageCopier
    from radixserve.memory.swa_hi_cache import SWAHiRadixCache

    pool = KVPool(2, 10, PS, 1, 1, window_layers=frozenset({1}), num_window_pages=10)
    win = WindowPages(10, 10, WINDOW, PS)
    alloc = WindowedPageAllocator(10, win)
    hier = KVHierarchy(pool, 20, window=win)
    if staged:
        hier.copier = hier.host.copier = PageCopier(pool.device, staged=True)
    cache = SWAHiRadixCache(alloc, PS, hier)
    glob, wind = pool.k_data[0], pool.k_data[1]

    def put(tokens: list[int]) -> list[int]:
        pages = alloc.alloc(len(tokens) // PS)
        for i, t in enumerate(tokens):
            glob[pages[i // PS], i % PS] = t
            wind[win.table[pages[i // PS]], i % PS] = t
        cached = cache.insert(tokens, pages)
        alloc.free(pages[: cached // PS])
        cache.check_invariants()
        return pages

    a, b = list(range(100, 140)), list(range(200, 240))
    pages = put(a)  # 10 pages
    for g in pages[2:5]:  # a's pages 2-4 lose their window KV (window-pool pressure)
        win.allocator.free([win.unmap(g)])
        win.num_evictable -= 1
    cache.check_invariants()
    put(b)  # L1 holds 10 pages: all of a goes to L2
    assert cache.hierarchy.stats.demoted_pages == 10 and cache.peek_prefix_len(a + [1]) == 0
    m = cache.match_prefix(a + [1])  # all 10 pages load back; every window is whole again
    cache.check_invariants()
    assert cache.hierarchy.stats.loaded_l2_pages == 10 and m.matched_len == 40
    got = m.pages
    assert [int(glob[g, 0]) for g in got] == a[::PS]
    have = [win.table[g] >= 0 for g in got]
    assert have == [True, True, False, False, False] + [True] * 5
    assert [int(wind[win.table[g], 0]) for g in got if win.table[g] >= 0] == [
        a[i * PS] for i in range(10) if have[i]
    ]
    # A prefix whose last window reaches the tombstones is cut back: 20 tokens need 3, 4.
    assert cache.match_prefix(a[:20] + [1]).matched_len == 8
    assert torch.equal(glob[got[0]].view(-1), torch.tensor([100.0, 101.0, 102.0, 103.0]))
    cache.check_invariants()
