"""PageAllocator: free list, eviction on shortage, typed OutOfPagesError, double-free detection."""

from __future__ import annotations

import pickle

import pytest

from radixserve.memory import OutOfPagesError, PageAllocator


def test_alloc_free_roundtrip() -> None:
    a = PageAllocator(8)
    assert a.num_free == 8 and a.num_used == 0
    p = a.alloc(3)
    assert p == [0, 1, 2] and a.num_free == 5
    assert a.alloc(0) == []
    a.free(p)
    assert a.num_free == 8
    assert a.alloc(3) == p  # LIFO: just-freed pages come back first, in order
    a.check_invariants()


def test_double_free_and_foreign_pages_raise() -> None:
    a = PageAllocator(4)
    p = a.alloc(2)
    a.free(p[:1])
    with pytest.raises(ValueError):
        a.free(p[:1])
    with pytest.raises(ValueError):
        a.free([p[1], p[1]])
    with pytest.raises(ValueError):
        a.free([99])
    with pytest.raises(ValueError):
        a.alloc(-1)
    a.check_invariants()
    assert a.num_free == 3


def test_short_alloc_asks_the_evictor_for_the_shortfall() -> None:
    a = PageAllocator(4)
    held = a.alloc(4)
    calls: list[int] = []

    def evict(n: int) -> int:
        calls.append(n)
        a.free(held[:n])
        del held[:n]
        return n

    a.set_evictor(evict, lambda: len(held))
    got = a.alloc(3)
    assert calls == [3] and len(got) == 3 and a.num_free == 0
    a.check_invariants()


def test_out_of_pages_is_typed_and_evicts_nothing_when_hopeless() -> None:
    a = PageAllocator(4)
    a.alloc(3)
    calls: list[int] = []
    a.set_evictor(lambda n: calls.append(n) or 0, lambda: 2)
    with pytest.raises(OutOfPagesError) as exc:
        a.alloc(4)  # free 1 + evictable 2 < 4
    assert (exc.value.needed, exc.value.free, exc.value.evictable) == (4, 1, 2)
    assert calls == [] and a.num_free == 1
    assert not a.can_alloc(4) and a.can_alloc(3)
    again = pickle.loads(pickle.dumps(exc.value))
    assert isinstance(again, OutOfPagesError) and again.needed == 4


def test_out_of_pages_without_evictor() -> None:
    a = PageAllocator(2)
    with pytest.raises(OutOfPagesError) as exc:
        a.alloc(3)
    assert exc.value.free == 2 and exc.value.evictable == 0
