"""KVPool: shapes, dtypes and scale layout per KV-cache dtype, for page sizes 1, 16 and 64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixkernels.kv_format import KVFormat
from radixserve.memory import KVPool, hugepages


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
def test_layout_matches_kv_format(page_size: int, kv_dtype: str) -> None:
    layers, pages, heads, dim = 3, 5, 3, 64
    pool = KVPool(layers, pages, page_size, heads, dim, kv_dtype=kv_dtype, act_dtype=torch.bfloat16)
    fmt = KVFormat.create(kv_dtype, torch.bfloat16, dim)
    assert pool.fmt == fmt
    assert len(pool.k_data) == len(pool.v_data) == layers
    for t in pool.k_data + pool.v_data:
        assert t.shape == (pages, page_size, heads, fmt.packed_head_dim)
        assert t.dtype == fmt.storage_dtype
        assert t.is_contiguous()
    if fmt.kv_dtype.has_token_scales:
        assert pool.k_scale is not None and pool.v_scale is not None
        for s in pool.k_scale + pool.v_scale:
            assert s.shape == (pages, page_size, heads) and s.dtype == torch.float32
    elif fmt.kv_dtype.has_head_scales:
        assert pool.k_scale is not None and pool.v_scale is not None
        for s in pool.k_scale + pool.v_scale:
            assert s.shape == (heads,) and s.dtype == torch.float32
            assert torch.equal(s, torch.ones(heads))
    else:
        assert pool.k_scale is None and pool.v_scale is None
    # Byte accounting agrees with the format (fp8 head scales are a few bytes on top).
    per_token = fmt.bytes_per_token(layers, heads)
    assert pool.bytes_per_page == per_token * page_size
    extra = 2 * layers * heads * 4 if fmt.kv_dtype.has_head_scales else 0
    assert pool.nbytes == per_token * pages * page_size + extra
    assert pool.num_slots == pages * page_size


def test_slot_addressing_and_layer_views_are_independent() -> None:
    pool = KVPool(2, 4, 16, 2, 8)
    page, offset = 2, 5
    slot = page * 16 + offset
    pool.k_flat(1)[slot] = 7.0
    assert torch.all(pool.k_data[1][page, offset] == 7.0)
    assert pool.k_data[0].abs().sum() == 0 and pool.v_data[1].abs().sum() == 0
    assert pool.k_data[1].abs().sum() == 7.0 * 2 * 8


def test_starts_zeroed_and_rejects_bad_sizes() -> None:
    pool = KVPool(1, 2, 4, 1, 4, kv_dtype="int8")
    assert (
        pool.k_data[0].abs().sum() == 0
        and pool.k_scale is not None
        and pool.k_scale[0].abs().sum() == 0
    )
    with pytest.raises(ValueError):
        KVPool(1, 0, 4, 1, 4)
    with pytest.raises(ValueError):
        KVPool(1, 2, 4, 1, 5, kv_dtype="int4")  # int4 packs two per byte


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's smaps")
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3", "int8", "int4"])
@pytest.mark.parametrize("env", ["1", "0"])
def test_a_cpu_pool_sits_on_huge_pages(
    kv_dtype: str, env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K and V of a pool of 2 MB or more are advised MADV_HUGEPAGE (unless
    RADIXSERVE_KV_HUGEPAGES=0), start zeroed and take what is stored."""
    monkeypatch.setenv("RADIXSERVE_KV_HUGEPAGES", env)
    pool = KVPool(2, 512, 16, 4, 64, kv_dtype=kv_dtype, act_dtype=torch.bfloat16)
    for t in (pool.k_data[1], pool.v_data[0]):
        assert t.is_contiguous() and int(t.view(torch.uint8).abs().sum()) == 0
    pool.k_flat(1)[7].view(torch.uint8).fill_(3)
    assert int(pool.k_data[1].view(torch.uint8).sum()) == 3 * pool.k_flat(1)[7].nbytes
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        advised = "hg" in hugepages.vm_flags(pool.k_data[0].data_ptr())
        assert advised == (env == "1")


def test_a_small_pool_stays_a_plain_allocation() -> None:
    pool = KVPool(1, 4, 16, 1, 8)
    assert "hg" not in hugepages.vm_flags(pool.k_data[0].data_ptr())
