"""Memory given back with ``madvise(MADV_DONTNEED)`` (memory/release.py): a tensor reads as
zeros afterwards, on plain and huge-page allocations, however its bytes fall on pages, and
only the whole pages inside it are given back (its neighbours' bytes untouched); a strided
view is zeroed, not advised. ``KVPool.release_memory`` covers every paged tensor: K and V,
the window pool's, int8's per-token scales (fp8's per-head scales stay)."""

from __future__ import annotations

import pytest
import torch

from radixserve.memory.pool import KVPool
from radixserve.memory.release import PAGE, discard


@pytest.mark.parametrize("offset", [0, 1, 4093])
def test_discard_zeroes_a_tensor_and_gives_back_only_its_whole_pages(offset: int) -> None:
    buf = torch.full((offset + 5 * PAGE + 7,), 7, dtype=torch.uint8)
    t = buf[offset : offset + 5 * PAGE]
    lo = -t.data_ptr() % PAGE
    whole = (5 * PAGE - lo) // PAGE * PAGE
    assert discard(t) == whole
    assert (
        not t.any()
        and bool((buf[:offset] == 7).all())
        and bool((buf[offset + 5 * PAGE :] == 7).all())
    )


def test_a_small_tensor_and_a_strided_view_are_zeroed_in_place() -> None:
    small = torch.ones(10)
    assert discard(small) == 0 and not small.any()
    grid = torch.ones(64, 2048)
    column = grid[:, 0]
    assert discard(column) == 0 and not column.any() and bool(grid[:, 1:].all())


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
def test_a_pool_released_reads_as_when_it_was_made(kv_dtype: str) -> None:
    pool = KVPool(
        4, 300, 16, 2, 64, kv_dtype=kv_dtype, window_layers=frozenset({1}), num_window_pages=40
    )
    fresh = [t.clone() for t in (*pool.part_tensors(False), *pool.part_tensors(True))]
    for t in (*pool.part_tensors(False), *pool.part_tensors(True)):
        (t.view(torch.uint8) if t.element_size() == 1 else t).fill_(3)
    scales = list(pool.k_scale or [])
    freed = pool.release_memory()
    assert 0.9 * pool.nbytes <= freed <= pool.nbytes
    after = [*pool.part_tensors(False), *pool.part_tensors(True)]
    assert all(torch.equal(a.view(torch.uint8), f.view(torch.uint8)) for a, f in zip(after, fresh))
    if kv_dtype == "fp8_e4m3":  # not paged: calibrated values stay
        assert all(bool((s == 1).all()) for s in scales)
