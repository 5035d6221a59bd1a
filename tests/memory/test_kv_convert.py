"""An L2 in a smaller KV dtype than L1: pages are converted with the KV-quant reference
rounding on demotion and widened exactly on load-back; a restart reads L2's format back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixkernels.reference import dequantize_ref, quantize_ref
from radixserve.memory import KVPool, PageAllocator
from radixserve.memory.hi_radix_cache import HiRadixCache
from radixserve.memory.hierarchy import KVHierarchy
from radixserve.memory.host_pool import PageCopier
from radixserve.memory.kv_convert import host_format

LAYERS, PS, HEADS, DIM = 2, 4, 3, 16


def _l1(pages: int = 8) -> KVPool:
    pool = KVPool(LAYERS, pages, PS, HEADS, DIM)
    g = torch.Generator().manual_seed(0)
    for t in pool.k_data + pool.v_data:
        t.copy_(torch.randn(t.shape, generator=g) * 3)
    return pool


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3", "int8"])
def test_demotion_rounds_once_and_load_back_widens_exactly(dtype: str) -> None:
    l1 = _l1()
    kv_dtype, act_dtype = host_format(l1, dtype)
    l2 = KVPool(LAYERS, 4, PS, HEADS, DIM, kv_dtype=kv_dtype, act_dtype=act_dtype)
    assert l2.bytes_per_page < l1.bytes_per_page
    before = [t.clone() for t in l1.k_data + l1.v_data]
    copier = PageCopier(l1.device)
    copier.copy(l1, [3, 1], l2, [0, 2])
    copier.copy(l2, [0, 2], l1, [6, 7])
    for layer in range(LAYERS):
        for i, data in enumerate((l1.k_data, l1.v_data)):
            orig = before[i * LAYERS + layer][[3, 1]].reshape(-1, HEADS, DIM)
            head = None
            if l2.fmt.kv_dtype.has_head_scales:
                head = (l2.k_scale if i == 0 else l2.v_scale)[layer]  # type: ignore[index]
            q, s = quantize_ref(orig, l2.fmt, head)
            scale = s if s is not None else head
            want = dequantize_ref(q, scale, l2.fmt).reshape(2, PS, HEADS, DIM)
            assert torch.equal(data[layer][[6, 7]], want)  # exactly the reference rounding
            err = (want - orig.reshape(2, PS, HEADS, DIM)).abs().max() / orig.abs().max()
            assert 0 < err < 0.07  # rounded, by no more than the format allows
            assert torch.equal(data[layer][:6], before[i * LAYERS + layer][:6])  # others intact


def test_a_restart_reads_l2_format_page_files(tmp_path: Path) -> None:
    """L3 files hold L2's bytes under a directory named by L2's layout: an int8 L2 restarts
    warm from its own files and never reads a full-precision L2's."""
    tokens = list(range(100, 116))  # 4 pages

    def tiered(dtype: str) -> tuple[KVPool, PageAllocator, HiRadixCache]:
        pool, alloc = _l1(16), PageAllocator(16)
        hier = KVHierarchy(pool, 8, tmp_path, "m", host_dtype=dtype)
        return pool, alloc, HiRadixCache(alloc, PS, hier)

    pool, alloc, cache = tiered("int8")
    pages = alloc.alloc(4)
    original = [t[pages].clone() for t in pool.k_data]
    cache.insert(tokens, pages)
    alloc.free([])
    assert cache.persist() == 4
    pool2, _, warm = tiered("int8")
    m = warm.match_prefix(tokens + [1])
    assert m.matched_len == 16
    for layer in range(LAYERS):
        got = pool2.k_data[layer][m.pages]
        err = (got - original[layer]).abs().max() / original[layer].abs().max()
        assert 0 < err < 0.01  # int8-rounded, not someone else's bytes
    _, _, other = tiered("auto")
    assert other.match_prefix(tokens + [1]).matched_len == 0
    warm.check_invariants()
