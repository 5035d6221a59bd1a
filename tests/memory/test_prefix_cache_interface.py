"""The prefix-cache interface is declared once (memory/prefix_cache.py) and the three caches
implement it, with the same signatures: the scheduler can hold any of them."""

from __future__ import annotations

import inspect

import pytest

from radixserve.memory import NoPrefixCache, PageAllocator, PrefixCache, RadixCache
from radixserve.memory.hi_radix_cache import HiRadixCache

METHODS = sorted(PrefixCache.__abstractmethods__)


@pytest.mark.parametrize("cls", [RadixCache, NoPrefixCache, HiRadixCache])
def test_every_cache_implements_the_interface(cls: type[PrefixCache]) -> None:
    assert issubclass(cls, PrefixCache)
    assert not getattr(cls, "__abstractmethods__", None), cls.__abstractmethods__
    for name in METHODS:
        declared = getattr(PrefixCache, name)
        if isinstance(declared, property):
            continue
        ours = inspect.signature(getattr(cls, name))
        theirs = inspect.signature(declared)
        assert list(ours.parameters) == list(theirs.parameters), (cls.__name__, name)


def test_the_interface_names_what_the_scheduler_uses() -> None:
    assert {"match_prefix", "lock", "unlock", "insert", "cache_prefix", "evict"} <= set(METHODS)


def test_the_no_cache_answers_as_an_empty_cache() -> None:
    alloc = PageAllocator(8)
    cache: PrefixCache = NoPrefixCache(alloc, page_size=2)
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.matched_len == 0 and m.pages == []
    cache.lock(m.node)
    pages = alloc.alloc(2)
    assert cache.insert([1, 2, 3, 4], pages) == 0  # the pages went back to the allocator
    cache.unlock(m.node)
    assert cache.num_cached_pages == 0 and cache.evict(4) == 0
    cache.check_invariants()


def test_an_incomplete_cache_cannot_be_built() -> None:
    class Half(PrefixCache):
        def evict(self, n_pages: int) -> int:
            return 0

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]
