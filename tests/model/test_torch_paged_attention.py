"""The torch paged attention backend equals radixkernels' reference on mixed ragged batches."""

from __future__ import annotations

import pytest
import torch
from alloc_peak import peak_bytes

from radixkernels.reference import paged_attention_ref
from radixserve.memory.pool import KVPool
from radixserve.model import native
from radixserve.model.attention import blocked, torch_paged
from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend
from radixserve.model.attention.windowed import masked_attention
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
    # The kernel reads unquantized, int8, int4 and fp8 pages.
    assert backend._native == (native_kernel and native.load())
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


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_key_blocks_merge_into_the_whole(
    monkeypatch: pytest.MonkeyPatch, kv_dtype: str, page_size: int
) -> None:
    """Histories cut into many key blocks (8 positions, or one 16-token page): decode rows of
    different lengths drop out of the later blocks, extends merge their prefix blocks with
    their causal part; the result is the reference's, within the same tolerance."""
    calls = 0
    inner = torch_paged.attention_with_lse

    def counted(*args: object, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal calls
        calls += 1
        return inner(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(blocked, "KV_BLOCK_TOKENS", 8)
    monkeypatch.setattr(torch_paged, "attention_with_lse", counted)
    test_matches_reference((9, 3), page_size, kv_dtype, native_kernel=False)
    # Unblocked, each layer makes 6 calls: one for the decodes, one for the fresh prefill,
    # two (prefix, then causal) for each of the two extends over a prefix.
    assert calls > 2 * 6


def test_transient_memory_does_not_grow_with_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer call on an int8 pool (the torch path), counted with torch's allocator events:
    a 64-row chunk over 4,096 cached tokens allocates at its peak what it does over 1,024,
    and so do two decode rows; before the key blocks, the chunk's mask and the dequantized
    history grew with the context."""
    monkeypatch.setattr(blocked, "KV_BLOCK_TOKENS", 256)
    hq, hkv, d, ps = 8, 2, 64, 16

    def peak(context: int, new: list[int]) -> int:
        prefix = [context] * len(new)
        num_pages = len(new) * (context + 64) // ps + 8
        fb = make_batch(prefix, new, ps, num_pages, seed=0)
        pool = KVPool(1, num_pages, ps, hkv, d, kv_dtype="int8")
        pool.k_data[0].random_(-127, 127)
        pool.v_data[0].random_(-127, 127)
        assert pool.k_scale is not None and pool.v_scale is not None
        pool.k_scale[0].fill_(0.01)
        pool.v_scale[0].fill_(0.01)
        backend = TorchPagedAttentionBackend(pool, native_kernel=False)
        t = fb.num_tokens
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
        backend.init_forward_metadata(fb)
        return peak_bytes(lambda: backend.forward(0, q, k, v, fb, d**-0.5))

    for rows in ([64], [1, 1]):
        short, long = peak(1024, rows), peak(4096, rows)
        assert long <= short * 1.01, (rows, short, long)
        # 4x the context's int8 history dequantized to float32 would add more than this
        dequantized = 2 * 4096 * hkv * d * 4 * len(rows)
        assert long < dequantized, (rows, long)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_key_blocks_accumulate_bfloat16_in_float32(
    monkeypatch: pytest.MonkeyPatch, kv_dtype: str
) -> None:
    """bfloat16 activations over 10 key blocks: the running output stays float32 between
    blocks and is rounded once, so the blocked result is as close to the float32 reference
    as the single call is (bf16 tolerance), not ten roundings away."""
    hq, hkv, d, ps = 9, 3, 32, 4
    prefix, extend = [75, 80, 3], [5, 1, 1]  # an extend over a prefix and two decodes
    num_pages = 64
    fb = make_batch(prefix, extend, ps, num_pages, seed=3)
    g = torch.Generator().manual_seed(4)
    hist_k = torch.randn(num_pages * ps, hkv, d, generator=g)
    hist_v = torch.randn(num_pages * ps, hkv, d, generator=g)
    t = fb.num_tokens
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))

    def run(block: int, dtype: torch.dtype) -> tuple[torch.Tensor, KVPool]:
        monkeypatch.setattr(blocked, "KV_BLOCK_TOKENS", block)
        pool = KVPool(1, num_pages, ps, hkv, d, kv_dtype=kv_dtype, act_dtype=dtype)
        from radixkernels.reference import store_kv_ref

        slots = torch.arange(num_pages * ps)
        store_kv_ref(
            pool.k_data[0],
            pool.v_data[0],
            _s(pool.k_scale, 0),
            _s(pool.v_scale, 0),
            hist_k,
            hist_v,
            slots,
            pool.fmt,
        )
        backend = TorchPagedAttentionBackend(pool, native_kernel=False)
        backend.init_forward_metadata(fb)
        out = backend.forward(0, q.to(dtype), k.to(dtype), v.to(dtype), fb, d**-0.5)
        return out, pool

    whole, pool = run(2048, torch.bfloat16)
    parts, _ = run(8, torch.bfloat16)
    ref = paged_attention_ref(
        q,
        pool.k_data[0],
        pool.v_data[0],
        _s(pool.k_scale, 0),
        _s(pool.v_scale, 0),
        pool.fmt,
        fb.page_table,
        fb.seq_lens,
        fb.extend_lens,
        fb.extend_start_loc,
        ps,
        d**-0.5,
    )
    err_whole = (whole.float() - ref).abs().max().item()
    err_parts = (parts.float() - ref).abs().max().item()
    assert err_parts <= 1.5 * err_whole + 1e-3, (err_whole, err_parts)


@pytest.mark.parametrize("window,softcap", [(None, 2.0), (70, None), (9, 2.0), (1, None)], ids=str)
def test_windowed_and_capped_attention_in_key_blocks(
    monkeypatch: pytest.MonkeyPatch, window: int | None, softcap: float | None
) -> None:
    """The torch path's windowed / soft-capped attention over 16-key blocks (an online
    softmax of its own: ATen's flash attention takes neither) equals the one-call
    ``masked_attention``; rows whose window starts past a block see nothing there."""
    g = torch.Generator().manual_seed(9)
    n, keys, hq, hkv, d = 20, 100, 6, 2, 16
    q = torch.randn(n, hq, d, generator=g) * 3  # scores well past the cap of 2
    k, v = torch.randn(keys, hkv, d, generator=g), torch.randn(keys, hkv, d, generator=g)
    k_pos = torch.arange(7, 7 + keys)
    q_pos = k_pos[-n:]
    whole = masked_attention(q, k, v, q_pos, k_pos, 0.25, window, softcap)
    monkeypatch.setattr(blocked, "KV_BLOCK_TOKENS", 16)
    parts = blocked.masked_attention_blocks(q, k, v, q_pos, k_pos, 0.25, window, softcap)
    torch.testing.assert_close(parts, whole, atol=2e-6, rtol=1e-5)
