"""The torch paged attention backend equals radixkernels' reference on mixed ragged batches."""

from __future__ import annotations

import pytest
import torch

from radixkernels.reference import paged_attention_ref
from radixserve.memory.pool import KVPool
from radixserve.model import native
from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend
from radixserve.model.forward_batch import ForwardBatch


def make_batch(
    prefix: list[int], extend: list[int], page_size: int, num_pages: int, seed: int
) -> ForwardBatch:
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    pages = [
        [perm.pop() for _ in range(-(-(p + e) // page_size))] for p, e in zip(prefix, extend)
    ]  # scattered
    return ForwardBatch.from_pages(pages, prefix, extend, page_size)


@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (4, 1)], ids=["mha", "gqa9/3", "mqa"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("native_kernel", [False, True], ids=["torch", "native"])
def test_matches_reference(
    heads: tuple[int, int], page_size: int, kv_dtype: str, native_kernel: bool
) -> None:
    hq, hkv = heads
    d = 32  # a head size the CPU kernel takes
    prefix = [0, 13, 5, 0, 40, 7]
    extend = [
        9,
        1,
        1,
        1,
        6,
        17,
    ]  # prefill, decodes (one with no prefix), extends over a cached prefix
    fb = make_batch(prefix, extend, page_size, num_pages=256 // page_size + 8, seed=hq)
    pool = KVPool(2, 256 // page_size + 8, page_size, hkv, d, kv_dtype=kv_dtype)
    ref_pool = KVPool(2, 256 // page_size + 8, page_size, hkv, d, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(1)
    # The cached prefixes: the same random history in both pools.
    for layer in range(2):
        for p in (pool, ref_pool):
            torch.manual_seed(layer)
            if kv_dtype == "auto":
                p.k_data[layer].normal_()
                p.v_data[layer].normal_()
    if kv_dtype != "auto":  # quantized: write the history through the backend's own store
        slots = []
        for b, n in enumerate(prefix):
            for pos in range(n):
                slots.append(int(fb.page_table[b, pos // page_size]) * page_size + pos % page_size)
        from radixkernels.reference import store_kv_ref

        for layer in range(2):
            k = torch.randn(len(slots), hkv, d, generator=g)
            v = torch.randn(len(slots), hkv, d, generator=g)
            for p in (pool, ref_pool):
                store_kv_ref(
                    p.k_data[layer],
                    p.v_data[layer],
                    _s(p.k_scale, layer),
                    _s(p.v_scale, layer),
                    k,
                    v,
                    torch.tensor(slots, dtype=torch.int64),
                    p.fmt,
                )
    backend = TorchPagedAttentionBackend(pool, native_kernel=native_kernel)
    assert backend._native == (native_kernel and kv_dtype == "auto" and native.load())
    t = fb.num_tokens
    for layer in range(2):
        q = torch.randn(t, hq, d, generator=g)
        k = torch.randn(t, hkv, d, generator=g)
        v = torch.randn(t, hkv, d, generator=g)
        backend.init_forward_metadata(fb)
        out = backend.forward(layer, q, k, v, fb, d**-0.5)
        from radixkernels.reference import store_kv_ref

        store_kv_ref(
            ref_pool.k_data[layer],
            ref_pool.v_data[layer],
            _s(ref_pool.k_scale, layer),
            _s(ref_pool.v_scale, layer),
            k,
            v,
            fb.out_cache_loc,
            ref_pool.fmt,
        )
        ref = paged_attention_ref(
            q,
            ref_pool.k_data[layer],
            ref_pool.v_data[layer],
            _s(ref_pool.k_scale, layer),
            _s(ref_pool.v_scale, layer),
            ref_pool.fmt,
            fb.page_table,
            fb.seq_lens,
            fb.extend_lens,
            fb.extend_start_loc,
            page_size,
            d**-0.5,
        )
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        assert torch.equal(pool.k_data[layer], ref_pool.k_data[layer])


def _s(scales: list[torch.Tensor] | None, layer: int) -> torch.Tensor | None:
    return None if scales is None else scales[layer]


def test_metadata_comes_from_one_explicit_call_per_batch() -> None:
    fb = make_batch([3, 0], [1, 5], 4, 16, seed=0)
    backend = TorchPagedAttentionBackend(KVPool(2, 16, 4, 2, 8))
    q, kv = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(0, q, kv, kv, fb, 0.3)  # a batch the backend was not prepared for
    backend.init_forward_metadata(fb)
    meta = backend._meta
    backend.forward(0, q, kv, kv, fb, 0.3)
    backend.forward(1, q, kv, kv, fb, 0.3)
    assert backend._meta is meta  # every layer reuses it
    other = make_batch([3, 0], [1, 5], 4, 16, seed=0)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(0, q, kv, kv, other, 0.3)


def test_batch_from_pages_rejects_too_few_pages() -> None:
    fb = ForwardBatch.from_pages([[3, 1]], [5], [2], 4)  # positions 5, 6 in page 1
    assert fb.out_cache_loc.tolist() == [5, 6] and fb.positions.tolist() == [5, 6]
    with pytest.raises(ValueError, match="cannot hold"):
        ForwardBatch.from_pages([[3]], [3], [2], 4)
