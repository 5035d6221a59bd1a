"""RadixCache unit tests: matching, splitting, page alignment, namespaces, locking, LRU eviction."""

from __future__ import annotations

import pytest

from radixserve.memory import NoPrefixCache, OutOfPagesError, PageAllocator, PrefixCache, RadixCache


def make(
    num_pages: int = 64, page_size: int = 1, disabled: bool = False
) -> tuple[PageAllocator, PrefixCache]:
    alloc = PageAllocator(num_pages)
    return alloc, (NoPrefixCache(alloc, page_size) if disabled else RadixCache(alloc, page_size))


def put(alloc: PageAllocator, cache: RadixCache, tokens: list[int], ns: object = None) -> list[int]:
    """Insert ``tokens`` like a finished request would; returns the pages now backing them."""
    ps = cache.page_size
    pages = alloc.alloc(-(-len(tokens) // ps))
    cached = cache.insert(tokens, pages, ns)
    alloc.free(pages[: cached // ps])
    alloc.free(pages[len(tokens) // ps :])  # partial last page: the tree never takes it
    return cache.match_prefix(tokens, ns, record_stats=False).pages


def test_empty_match() -> None:
    alloc, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.pages == [] and m.matched_len == 0 and m.node.is_root
    assert cache.stats.queried_tokens == 3 and cache.stats.hit_tokens == 0
    cache.check_invariants()


def test_insert_then_match_full_and_prefix() -> None:
    alloc, cache = make()
    pages = put(alloc, cache, [1, 2, 3, 4])
    assert cache.total_cached_tokens == 4 and cache.num_evictable_pages == 4
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.matched_len == 4 and m.pages == pages
    m = cache.match_prefix([1, 2])
    assert m.matched_len == 2 and m.pages == pages[:2] and m.node.depth == 2
    assert cache.match_prefix([2, 1]).matched_len == 0
    cache.check_invariants()


def test_match_splits_mid_edge_and_keeps_identity_of_lower_part() -> None:
    alloc, cache = make()
    pages = put(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    leaf = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).node
    cache.lock(leaf)
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.matched_len == 3 and m.pages == pages[:3]
    assert m.node.key == (1, 2, 3) and list(m.node.children.values()) == [leaf]
    assert leaf.key == (4, 5, 6, 7, 8) and leaf.depth == 8 and leaf.holders == 1
    assert m.node.lock_ref == 1 and m.node.holders == 0  # the split kept the lock on the path
    cache.check_invariants()
    cache.unlock(leaf)
    cache.check_invariants()


def test_page_aligned_matching_and_split_with_page_size_4() -> None:
    alloc, cache = make(page_size=4)
    toks = list(range(100, 112))  # 3 pages
    pages = put(alloc, cache, toks)
    assert len(pages) == 3
    # Diverges at token 6: only the first whole page matches.
    m = cache.match_prefix(toks[:6] + [0, 0, 0, 0])
    assert m.matched_len == 4 and m.pages == pages[:1] and m.node.key == tuple(toks[:4])
    # A query of 11 tokens rounds down to 8.
    m = cache.match_prefix(toks[:11])
    assert m.matched_len == 8 and m.pages == pages[:2]
    assert cache.match_prefix(toks[:3]).matched_len == 0
    cache.check_invariants()


def test_partial_last_page_is_not_inserted() -> None:
    alloc, cache = make(num_pages=8, page_size=4)
    pages = alloc.alloc(3)
    assert cache.insert(list(range(10)), pages) == 0
    assert cache.num_cached_pages == 2 and cache.total_cached_tokens == 8
    cache.check_invariants(private_pages=pages[2:])  # the third page is still the caller's
    alloc.free(pages[2:])
    cache.check_invariants()
    with pytest.raises(ValueError):
        cache.insert(list(range(12)), alloc.alloc(2))


def test_insert_already_cached_prefix_returns_cached_len() -> None:
    alloc, cache = make()
    tree_pages = put(alloc, cache, [1, 2, 3, 4, 5, 6])
    mine = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], mine) == 4
    assert cache.num_cached_pages == 6  # nothing new: the tree kept its pages
    cache.check_invariants(private_pages=mine)
    alloc.free(mine)
    # Diverging insert: 3 shared, 2 new.
    mine = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 7, 8], mine) == 3
    alloc.free(mine[:3])
    assert cache.num_cached_pages == 8
    m = cache.match_prefix([1, 2, 3, 7, 8])
    assert m.pages == tree_pages[:3] + mine[3:]
    cache.check_invariants()


def test_namespaces_never_share() -> None:
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3], ns="tenant-a")
    assert cache.match_prefix([1, 2, 3]).matched_len == 0
    assert cache.match_prefix([1, 2, 3], "tenant-b").matched_len == 0
    a = cache.match_prefix([1, 2, 3], "tenant-a")
    assert a.matched_len == 3
    b_pages = put(alloc, cache, [1, 2, 3], ns="tenant-b")
    assert set(b_pages).isdisjoint(a.pages)
    cache.check_invariants()
    assert cache.evict(100) == 6
    assert set(cache._roots) == {None}  # emptied namespace roots are dropped
    cache.check_invariants()


def test_lru_eviction_order_and_partial_tail_eviction() -> None:
    alloc, cache = make()
    put(alloc, cache, [1, 1, 1])
    b = put(alloc, cache, [2, 2, 2])
    put(alloc, cache, [3, 3, 3])
    cache.match_prefix([1, 1, 1])  # A is now the most recent; B the least
    assert cache.evict(2) == 2  # trims B's tail only: B keeps its first page
    assert cache.peek_prefix_len([2, 2, 2]) == 1
    assert set(b[1:]) <= alloc.free_pages() and b[0] not in alloc.free_pages()
    cache.check_invariants()
    assert cache.evict(1) == 1  # the rest of B (peek does not refresh it)
    assert cache.peek_prefix_len([2, 2, 2]) == 0
    assert cache.evict(2) == 2  # then C's tail
    assert cache.peek_prefix_len([3, 3, 3]) == 1 and cache.peek_prefix_len([1, 1, 1]) == 3
    assert cache.evict(100) == 4
    assert cache.num_cached_pages == 0 and alloc.num_free == 64 and cache.stats.evicted_pages == 9
    cache.check_invariants()


def test_lru_order_whole_leaves() -> None:
    alloc, cache = make()
    for t in (10, 20, 30, 40):
        put(alloc, cache, [t, t + 1])
    cache.match_prefix([20, 21])
    cache.match_prefix([10, 11])
    order = []
    for _ in range(4):
        assert cache.evict(2) == 2
        remaining = {t for t in (10, 20, 30, 40) if cache.peek_prefix_len([t, t + 1]) == 2}
        order.append(({10, 20, 30, 40} - remaining - set(order)).pop())
    assert order == [30, 40, 20, 10]


def test_parent_becomes_evictable_after_its_children() -> None:
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    put(alloc, cache, [1, 2, 5, 6])  # tree: [1,2] -> {[3,4], [5,6]}
    shared = cache.match_prefix([1, 2], record_stats=False).node
    assert not shared.is_leaf and shared not in cache._lru
    assert cache.evict(4) == 4  # both leaves go first, though [1,2] was touched last
    assert cache.num_cached_pages == 2 and shared in cache._lru
    cache.check_invariants()
    assert cache.evict(10) == 2
    cache.check_invariants()


def test_locked_path_is_never_evicted() -> None:
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    put(alloc, cache, [1, 2, 7, 8])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.node)
    assert cache.num_protected_pages == 4 and cache.num_evictable_pages == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3, 4], record_stats=False).pages == m.pages
    cache.check_invariants()
    cache.unlock(m.node)
    assert cache.num_protected_pages == 0 and cache.evict(100) == 4
    cache.check_invariants()
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)
    with pytest.raises(RuntimeError):
        cache.lock(m.node)  # evicted


def test_alloc_evicts_through_the_cache_and_raises_typed_error() -> None:
    alloc, cache = make(num_pages=8)
    put(alloc, cache, [1, 2, 3, 4])
    locked = cache.match_prefix([9, 9])
    held = alloc.alloc(4)
    assert alloc.num_free == 0 and cache.num_evictable_pages == 4
    got = alloc.alloc(3)  # evicts 3 LRU pages
    assert len(got) == 3 and cache.num_cached_pages == 1 and cache.stats.evicted_pages == 3
    cache.check_invariants(private_pages=held + got)
    with pytest.raises(OutOfPagesError) as exc:
        alloc.alloc(2)
    assert (exc.value.free, exc.value.evictable) == (0, 1)
    assert cache.num_cached_pages == 1  # a hopeless allocation evicts nothing
    del locked


def test_cache_prefix_moves_pages_and_lock() -> None:
    alloc, cache = make(page_size=4)
    prompt = list(range(10))
    m = cache.match_prefix(prompt)
    cache.lock(m.node)
    pages = m.pages + alloc.alloc(3)
    # After a first chunk of 6 tokens: one whole page goes to the tree.
    c = cache.cache_prefix(prompt[:6], pages, m.node)
    assert c.cached_len == 4 and c.pages == pages and c.node.depth == 4 and c.node.holders == 1
    cache.check_invariants(private_pages=c.pages[1:])
    assert cache.num_protected_pages == 1
    # The whole prompt: two whole pages cached, the partial third stays private.
    c2 = cache.cache_prefix(prompt, c.pages, c.node)
    assert c2.cached_len == 8 and c2.pages == pages and c.node.holders == 0 and c2.node.holders == 1
    cache.check_invariants(private_pages=c2.pages[2:])
    # Finish.
    cache.unlock(c2.node)
    alloc.free(c2.pages[c2.cached_len // 4 :])
    cache.check_invariants()
    assert cache.num_evictable_pages == 2 and cache.match_prefix(prompt).matched_len == 8


def test_cache_prefix_frees_duplicates_of_a_concurrent_request() -> None:
    alloc, cache = make(page_size=2)
    prompt = [5, 6, 7, 8, 9]
    reqs = []
    for _ in range(2):  # both miss, both compute the same prompt
        m = cache.match_prefix(prompt)
        cache.lock(m.node)
        reqs.append((m.node, m.pages + alloc.alloc(3)))
    (n1, p1), (n2, p2) = reqs
    c1 = cache.cache_prefix(prompt, p1, n1)
    free_before = alloc.num_free
    c2 = cache.cache_prefix(prompt, p2, n2)
    assert alloc.num_free == free_before + 2  # request 2's two duplicate whole pages
    assert c2.pages == p1[:2] + p2[2:] and c2.node is c1.node and c1.node.holders == 2
    cache.check_invariants(private_pages=[p1[2], p2[2]])
    for c in (c1, c2):
        cache.unlock(c.node)
        alloc.free(c.pages[c.cached_len // 2 :])
    cache.check_invariants()


def test_cache_prefix_from_matched_node_mid_edge() -> None:
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3, 8, 9])
    cache.lock(m.node)
    pages = m.pages + alloc.alloc(2)
    c = cache.cache_prefix([1, 2, 3, 8, 9], pages, m.node)
    assert c.pages == pages and c.cached_len == 5 and c.node.depth == 5
    cache.check_invariants()
    cache.unlock(c.node)
    cache.check_invariants()
    with pytest.raises(ValueError):
        cache.cache_prefix([1, 2], [], c.node)  # shorter than what the node covers


def test_no_prefix_cache_same_interface_no_reuse() -> None:
    alloc, cache = make(num_pages=8, disabled=True)
    assert not cache.reuses_prefixes and cache.peek_prefix_len([1, 2, 3]) == 0
    pages = alloc.alloc(3)
    assert cache.insert([1, 2, 3], pages) == 0
    assert alloc.num_free == 8 and cache.num_cached_pages == 0
    m = cache.match_prefix([1, 2, 3])
    assert m.matched_len == 0 and m.node.is_root
    cache.lock(m.node)
    pages = alloc.alloc(3)
    c = cache.cache_prefix([1, 2, 3], pages, m.node)
    assert c.cached_len == 0 and c.pages == pages
    cache.check_invariants(private_pages=pages)
    cache.unlock(c.node)
    alloc.free(c.pages)
    assert cache.evict(5) == 0 and cache.stats.queried_tokens == 3 and cache.stats.hit_tokens == 0
    cache.check_invariants()
    with pytest.raises(AssertionError):
        cache.check_invariants(private_pages=[0])  # a free page claimed as private
    with pytest.raises(RuntimeError):
        cache.lock(RadixCache(PageAllocator(1), 1).match_prefix([1]).node)  # not this cache's node


def test_reset_frees_everything_and_keeps_counters() -> None:
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3], ns="x")
    put(alloc, cache, [4, 5])
    cache.match_prefix([4, 5])
    m = cache.match_prefix([1, 2, 3], "x")
    cache.lock(m.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(m.node)
    before = cache.stats
    cache.reset()
    assert alloc.num_free == 64 and cache.num_cached_pages == 0 and cache.stats == before
    assert before.hit_tokens == 5 and before.queried_tokens == 5 and before.hit_rate == 1.0
    cache.check_invariants()


def test_peek_does_not_touch_the_tree() -> None:
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    nodes_before = len(cache._lru)
    clock = cache._clock
    assert cache.peek_prefix_len([1, 2, 9]) == 2
    assert cache.peek_prefix_len([1, 2, 3, 4, 5]) == 4
    assert cache._clock == clock and len(cache._lru) == nodes_before
    assert cache.match_prefix([1, 2, 9]).node.key == (1, 2)  # a real match splits


def test_evict_frees_exactly_min_of_request_and_evictable() -> None:
    alloc, cache = make(page_size=2)
    put(alloc, cache, list(range(20)))
    put(alloc, cache, list(range(10)) + [99] * 6)
    total = cache.num_evictable_pages
    assert total == 13
    assert cache.evict(4) == 4 and cache.num_evictable_pages == total - 4
    assert cache.evict(100) == total - 4
    cache.check_invariants()


def test_long_edge_mismatch_positions() -> None:
    """The galloping compare finds the exact divergence deep inside a long edge."""
    for ps in (1, 4):
        alloc, cache = make(num_pages=5000, page_size=ps)
        base = list(range(4000))
        put(alloc, cache, base)
        for cut in (ps, 64, 65, 1000, 2047, 3999):
            q = base[:cut] + [-1] * 8
            want = cut // ps * ps
            assert cache.peek_prefix_len(q) == want
            assert cache.match_prefix(q).matched_len == want
        cache.check_invariants()


def test_lru_index_stays_bounded_under_lock_churn() -> None:
    """Stale heap entries (from lock/unlock and access refreshes) are compacted away."""
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [4, 5, 6])
    for _ in range(3000):
        m = cache.match_prefix([1, 2, 3])
        cache.lock(m.node)
        cache.unlock(m.node)
    assert len(cache._lru.heap_entries()) <= 2 * len(cache._lru) + 1025
    cache.check_invariants()
    assert cache.evict(3) == 3 and cache.peek_prefix_len([1, 2, 3]) == 3  # [4,5,6] was older


def test_misses_in_unknown_namespaces_leave_no_roots_behind() -> None:
    alloc, cache = make()
    for i in range(100):
        m = cache.match_prefix([1, 2, 3], namespace=f"salt-{i}")
        assert m.matched_len == 0 and m.node.is_root and m.node.namespace == f"salt-{i}"
        cache.lock(m.node)
        cache.unlock(m.node)
    assert set(cache._roots) == {None}
    # A request that matched in a fresh namespace can still cache into it.
    m = cache.match_prefix([1, 2, 3], namespace="x")
    cache.lock(m.node)
    c = cache.cache_prefix([1, 2, 3], alloc.alloc(3), m.node, namespace="x")
    assert c.cached_len == 3 and cache.match_prefix([1, 2, 3], "x").matched_len == 3
    cache.unlock(c.node)
    cache.check_invariants()
