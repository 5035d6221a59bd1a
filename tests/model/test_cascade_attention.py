"""Cascade (shared-prefix) attention: grouping by page ids, the LSE merge, and the backend
on batches whose sequences share cached pages, against radixkernels' reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_batches import shared_batch
from paged_reference import layer0, reference_attention

from radixkernels.reference import store_kv_ref
from radixserve.memory.pool import KVPool
from radixserve.model import native
from radixserve.model.attention import blocked
from radixserve.model.attention.cascade import (
    SharedGroup,
    attention_with_lse,
    merge_partial,
    shared_prefix_groups,
)
from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend
from radixserve.model.forward_batch import ForwardBatch

# -- grouping --------------------------------------------------------------------------


def test_groups_follow_shared_leading_pages() -> None:
    a = [1, 2, 3, 4, 10]
    b = [1, 2, 3, 4, 11]
    c = [1, 2, 3, 5, 12]  # diverges after 3 pages
    d = [7, 8, 9, 13, 14]  # another prefix, alone
    groups = shared_prefix_groups([a, b, c, d], caps=[4, 4, 4, 4], min_pages=2)
    assert groups == [SharedGroup([0, 1, 2], 3)]


def test_a_member_that_would_shrink_the_group_too_much_starts_its_own() -> None:
    trunk = list(range(100, 140))
    rows = [trunk + [i] for i in range(4)] + [
        trunk[:3] + [200 + i for i in range(38)] for _ in range(1)
    ]
    groups = shared_prefix_groups(rows, caps=[40] * 5, min_pages=2)
    assert groups == [
        SharedGroup([0, 1, 2, 3], 40)
    ]  # joining would cut 37 pages from 4 members to save 3


def test_caps_bound_the_shared_part() -> None:
    same = [1, 2, 3, 4]
    groups = shared_prefix_groups([same, same], caps=[3, 1], min_pages=1)
    assert groups == [SharedGroup([0, 1], 1)]  # never past a member's first new row
    assert shared_prefix_groups([same, same], caps=[3, 1], min_pages=2) == []
    assert shared_prefix_groups([same], caps=[3], min_pages=1) == []  # a group of one is no group


# -- the merge -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_parts_merge_into_the_whole(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 3, 16, generator=g).to(dtype)
    k = torch.randn(2, 2, 40, 16, generator=g).to(dtype)
    v = torch.randn(2, 2, 40, 16, generator=g).to(dtype)
    whole, _ = attention_with_lse(q, k, v, None, 0.25)
    o1, l1 = attention_with_lse(q, k[:, :, :25], v[:, :, :25], None, 0.25)
    o2, l2 = attention_with_lse(q, k[:, :, 25:], v[:, :, 25:], None, 0.25)
    ref = F.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(3, 1), v.float().repeat_interleave(3, 1), scale=0.25
    )
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(whole.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(merge_partial(o1, l1, o2, l2).float(), ref, atol=tol, rtol=tol)


# -- the backend on shared pages ---------------------------------------------------------


@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (4, 1)], ids=["mha", "gqa9/3", "mqa"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("native_kernel", [False, True], ids=["torch", "native"])
def test_backend_with_shared_pages_matches_reference(
    heads: tuple[int, int], kv_dtype: str, page_size: int, native_kernel: bool
) -> None:
    hq, hkv = heads
    d = 32  # a head size the CPU kernel takes
    trunk = 24 // page_size  # 24 shared tokens
    prefix = [24, 30, 24, 41, 25]
    extend = [1, 1, 1, 9, 5]  # decodes and extends over the same trunk
    num_pages = 256 // page_size
    fb = shared_batch(trunk, prefix, extend, page_size, num_pages)
    pool = KVPool(1, num_pages, page_size, hkv, d, kv_dtype=kv_dtype)
    ref_pool = KVPool(1, num_pages, page_size, hkv, d, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(hq)
    # The cached history, identical in both pools: every slot holds some random K/V.
    all_slots = torch.arange(num_pages * page_size)
    hk = torch.randn(len(all_slots), hkv, d, generator=g)
    hv = torch.randn(len(all_slots), hkv, d, generator=g)
    for p in (pool, ref_pool):
        store_kv_ref(
            p.k_data[0], p.v_data[0], layer0(p.k_scale), layer0(p.v_scale), hk, hv, all_slots, p.fmt
        )

    backend = TorchPagedAttentionBackend(pool, native_kernel=native_kernel)
    backend.cascade_min_tokens = 8
    t = fb.num_tokens
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    backend.init_forward_metadata(fb)
    out = backend.forward(0, q, k, v, fb, d**-0.5)
    meta = backend._meta
    # The kernel reads bf16/fp32 pages and int8/int4/fp8 pages alike.
    assert (meta.native is not None) == (native_kernel and native.load())
    if meta.native is None:
        assert len(meta.shared) == 1 and meta.shared[0].shape[0] == 1  # one group
        assert meta.shared[0].pages.numel() == trunk
        assert meta.shared[0].rows.numel() == t  # every row is in the one group
    else:  # the kernel took the whole batch, one group over the trunk
        assert (
            meta.native.group_start.tolist() == [0, 5] and meta.native.shared_pages.numel() == trunk
        )
    _check_against_reference(out, q, k, v, fb, ref_pool, page_size, d)


def _check_against_reference(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fb: ForwardBatch,
    ref_pool: KVPool,
    page_size: int,
    d: int,
) -> None:
    """``out`` equals the reference attention after the reference pool stored the step's K/V."""
    ref = reference_attention(q, k, v, fb, ref_pool, page_size, d**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("big_extend", [1, 40], ids=["decodes", "with-a-long-extend"])
@pytest.mark.parametrize("native_kernel", [False, True], ids=["torch", "native"])
def test_groups_of_different_sizes_match_reference(big_extend: int, native_kernel: bool) -> None:
    """Two trunks of different lengths, groups of different sizes: padded queries and keys
    in one call, or (a long extend in one group) separate calls."""
    hq, hkv, d, ps = 6, 2, 32, 4
    prefix = [24, 30, 36, 33, 40, 32, 35]
    extend = [1, big_extend, 1, 1, 1, 1, 3]
    trunk_of = [0, 0, 1, 1, 1, 1, 1]
    fb = shared_batch([6, 8], prefix, extend, ps, 96, trunk_of)  # trunks of 24 and 32 tokens
    pool = KVPool(1, 96, ps, hkv, d)
    ref_pool = KVPool(1, 96, ps, hkv, d)
    g = torch.Generator().manual_seed(5)
    for p in (pool, ref_pool):
        p.k_data[0].copy_(
            torch.randn(p.k_data[0].shape, generator=torch.Generator().manual_seed(1))
        )
        p.v_data[0].copy_(
            torch.randn(p.v_data[0].shape, generator=torch.Generator().manual_seed(2))
        )
    backend = TorchPagedAttentionBackend(pool, native_kernel=native_kernel)
    backend.cascade_min_tokens = 8
    t = fb.num_tokens
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    backend.init_forward_metadata(fb)
    out = backend.forward(0, q, k, v, fb, d**-0.5)
    meta = backend._meta
    assert meta is not None
    assert (meta.native is not None) == (native_kernel and native.load())
    if meta.native is None:
        assert sorted(c.shape[0] for c in meta.shared) == ([2] if big_extend == 1 else [1, 1])
    else:  # the kernel took the whole batch: one group per trunk
        assert meta.native.group_start.tolist() == [0, 2, 7]
    _check_against_reference(out, q, k, v, fb, ref_pool, ps, d)


def test_short_shared_prefix_is_attended_per_sequence() -> None:
    fb = shared_batch(2, [8, 9], [1, 1], 4, 32)
    backend = TorchPagedAttentionBackend(KVPool(1, 32, 4, 2, 8), native_kernel=False)
    q, kv = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    backend.init_forward_metadata(fb)
    backend.forward(0, q, kv, kv, fb, 0.3)
    assert backend._meta is not None and backend._meta.shared == []  # 8 tokens < cascade_min_tokens


def test_kept_shared_kv_is_reused_only_by_the_next_forward() -> None:
    """Shared K/V gathered in one forward serve the next forward with the same groups; a
    forward without them drops them, so pages rewritten in between are read afresh."""
    hq, hkv, d, ps = 4, 2, 8, 4
    prefix, extend = [24, 28, 25], [1, 1, 1]
    pool = KVPool(1, 64, ps, hkv, d)
    backend = TorchPagedAttentionBackend(pool, native_kernel=False)
    backend.cascade_min_tokens = 8
    g = torch.Generator().manual_seed(7)

    def fill() -> None:
        pool.k_data[0].copy_(torch.randn(pool.k_data[0].shape, generator=g))
        pool.v_data[0].copy_(torch.randn(pool.v_data[0].shape, generator=g))

    def step(fb: ForwardBatch) -> None:
        t = fb.num_tokens
        q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
        ref_pool = KVPool(1, 64, ps, hkv, d)
        ref_pool.k_data[0].copy_(pool.k_data[0])
        ref_pool.v_data[0].copy_(pool.v_data[0])
        backend.init_forward_metadata(fb)
        out = backend.forward(0, q, k, v, fb, d**-0.5)
        _check_against_reference(out, q, k, v, fb, ref_pool, ps, d)

    fill()
    step(shared_batch(6, prefix, extend, ps, 64))
    kept = dict(backend._shared_kv)
    assert len(kept) == 1 and next(iter(kept.values()))[0] is not None  # layer 0 gathered and kept
    step(shared_batch(6, prefix, extend, ps, 64))  # the same groups: the kept K/V serve again
    assert backend._shared_kv.keys() == kept.keys()
    step(shared_batch(0, [5], [3], ps, 64))  # a forward with no group drops them ...
    assert backend._shared_kv == {}
    fill()  # ... so pages reused for other tokens meanwhile are not read stale
    step(shared_batch(6, prefix, extend, ps, 64))


def test_shared_kv_budget_bounds_what_is_kept() -> None:
    fb = shared_batch(6, [24, 28], [1, 1], 4, 64)
    backend = TorchPagedAttentionBackend(KVPool(2, 64, 4, 2, 8), native_kernel=False)
    backend.cascade_min_tokens = 8
    backend.shared_kv_bytes = 6 * 4 * (2 * 2 * 2 * 8 * 4) - 1  # one byte short of the trunk's K/V
    q, kv = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    backend.init_forward_metadata(fb)
    backend.forward(0, q, kv, kv, fb, 0.3)
    assert (
        backend._shared_kv == {}
        and backend._meta is not None
        and backend._meta.shared[0].kv is None
    )


def test_shared_parts_in_key_blocks_match_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared trunks (24 and 32 tokens, padded into one call) and the members' own parts cut
    into blocks of 8 positions: groups whose trunk ends drop out of the later blocks; the
    kept blocks serve the next forward."""
    monkeypatch.setattr(blocked, "KV_BLOCK_TOKENS", 8)
    test_groups_of_different_sizes_match_reference(1, native_kernel=False)
    test_groups_of_different_sizes_match_reference(40, native_kernel=False)
    test_backend_with_shared_pages_matches_reference((9, 3), "int8", 4, native_kernel=False)
    test_kept_shared_kv_is_reused_only_by_the_next_forward()
