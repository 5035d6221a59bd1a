"""The CPU attention kernel over int8, int4 and fp8 pages against the torch path on the same codes.

Both read the same stored codes and decode them alike (``code.float() * scale``, rounded to
the activations' dtype), so they differ only in how the attention sums: float32 within 2e-5
(a float32 sum over thousands of keys in another order), bf16 within 2e-2 (one bf16 step at 2-4;
bf16 queries over int8 pages may take integer products instead, closer to exact than either,
test_native_int8_attention.py). int4 rows are Hadamard-rotated: the torch path rotates each
decoded key and value back, the kernel attends in the rotated basis (its queries and outputs
rotated instead), so with bf16 queries their values round in different bases; the same
tolerances hold.
Lengths cross pages, the kernel's 64-key blocks and 128-key chunks, and reach past 7,000
keys; rows are decodes and extends (over a cached prefix, and a fresh prefill) beside each
other, on a 9/3 GQA head layout.
"""

from __future__ import annotations

import pytest
import torch

from radixkernels.reference import dequantize_ref, hadamard_rotate, store_kv_ref, unpack_int4
from radixserve.memory.pool import KVPool
from radixserve.model import native
from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend
from radixserve.model.forward_batch import ForwardBatch

pytestmark = pytest.mark.skipif(
    not native.load(), reason="the CPU kernel did not build here (see the log)"
)

QUANT = ["int8", "int4", "fp8_e4m3", "fp8_e5m2"]
HQ, HKV, D = 9, 3, 64
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _pool(kv_dtype: str, act: torch.dtype, page_size: int, num_pages: int) -> KVPool:
    """A one-layer pool; fp8's per-head scales set apart from their default 1.0."""
    pool = KVPool(1, num_pages, page_size, HKV, D, kv_dtype=kv_dtype, act_dtype=act)
    if pool.fmt.kv_dtype.has_head_scales:
        assert pool.k_scale is not None and pool.v_scale is not None
        pool.k_scale[0].copy_(torch.tensor([0.5, 1.0, 2.0]))
        pool.v_scale[0].copy_(torch.tensor([0.25, 1.0, 4.0]))
    return pool


def _batch(prefix: list[int], extend: list[int], ps: int, seed: int) -> ForwardBatch:
    """Sequences on scattered pages of a pool of just enough pages (plus a spare)."""
    need = [-(-(p + e) // ps) for p, e in zip(prefix, extend)]
    perm = torch.randperm(sum(need) + 1, generator=torch.Generator().manual_seed(seed)).tolist()
    pages = [[perm.pop() for _ in range(n)] for n in need]
    return ForwardBatch.from_pages(pages, prefix, extend, ps)


def _fill_history(pool: KVPool, fb: ForwardBatch, prefix: list[int], seed: int) -> None:
    """Store every sequence's cached prefix, quantized through the torch store."""
    assert fb.page_lists_cpu is not None
    ps = pool.page_size
    slots = [
        fb.page_lists_cpu[b][pos // ps] * ps + pos % ps
        for b, n in enumerate(prefix)
        for pos in range(n)
    ]
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(len(slots), HKV, D, generator=g) * 2
    v = torch.randn(len(slots), HKV, D, generator=g)
    scales = (pool.k_scale, pool.v_scale)
    store_kv_ref(
        pool.k_data[0],
        pool.v_data[0],
        None if scales[0] is None else scales[0][0],
        None if scales[1] is None else scales[1][0],
        k.to(pool.fmt.act_dtype),
        v.to(pool.fmt.act_dtype),
        torch.tensor(slots, dtype=torch.int64),
        pool.fmt,
    )


def _both_paths(
    kv_dtype: str, act: torch.dtype, prefix: list[int], extend: list[int], ps: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer call on the kernel and on the torch path, each on its own copy of one pool."""
    fb = _batch(prefix, extend, ps, seed)
    num_pages = max(p for pages in fb.page_lists_cpu or [] for p in pages) + 2
    outs, pools = [], []
    g = torch.Generator().manual_seed(seed + 1)
    t = fb.num_tokens
    q, k, v = (torch.randn(t, h, D, generator=g).to(act) for h in (HQ, HKV, HKV))
    for kernel in (True, False):
        pool = _pool(kv_dtype, act, ps, num_pages)
        _fill_history(pool, fb, prefix, seed)
        backend = TorchPagedAttentionBackend(pool, native_kernel=kernel)
        assert backend._native == kernel  # the path under test is the one taken
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(0, q, k, v, fb, D**-0.5))
        pools.append(pool)
    # The kernel's store quantizes the new rows as the torch store does, bit for bit.
    for name in ("k_data", "v_data", "k_scale", "v_scale"):
        a, b = (getattr(p, name)[0] for p in pools)
        assert (
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            if a.element_size() == 1
            else torch.equal(a, b)
        )
    return outs[0], outs[1]


@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ps", [1, 16])
def test_kernel_equals_torch_path_on_mixed_batches(
    kv_dtype: str, act: torch.dtype, ps: int
) -> None:
    # decodes over 1, 64 (a block), 128 (a chunk), 129, 16 (a page) and 18 keys; an extend
    # of 37 rows over 200 cached keys (mid-page, mid-block); a fresh 40-row prefill
    prefix = [0, 63, 127, 128, 15, 17, 200, 0]
    extend = [1, 1, 1, 1, 1, 1, 37, 40]
    kernel, torch_path = _both_paths(kv_dtype, act, prefix, extend, ps, seed=3)
    tol = TOL[act]
    torch.testing.assert_close(kernel.float(), torch_path.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8_e4m3"])
def test_kernel_equals_torch_path_past_7000_keys(kv_dtype: str) -> None:
    """Two decode rows past 7,000 keys (one ending a page, one a key past it: the decode is
    split over the threads, chunk by chunk) beside a 24-row extend over 7,100 cached keys."""
    prefix, extend = [7167, 7168, 7100], [1, 1, 24]
    kernel, torch_path = _both_paths(kv_dtype, torch.float32, prefix, extend, 16, seed=5)
    torch.testing.assert_close(kernel, torch_path, atol=2e-5, rtol=2e-5)
    kernel, torch_path = _both_paths(kv_dtype, torch.bfloat16, prefix, extend, 16, seed=6)
    torch.testing.assert_close(kernel.float(), torch_path.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_row_equals_prefill_row(kv_dtype: str, act: torch.dtype) -> None:
    """A prompt's prefill, then the decode step of its last position over the pages the
    prefill wrote: the decode row's output is the prefill row's, bit for bit."""
    n, ps = 300, 16  # three chunks: the decode step splits them over the threads
    pool = _pool(kv_dtype, act, ps, -(-n // ps) + 1)
    backend = TorchPagedAttentionBackend(pool)
    assert backend._native and backend.row_exact
    pages = list(range(-(-n // ps)))
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, h, D, generator=g).to(act) for h in (HQ, HKV, HKV))
    prefill = ForwardBatch.from_pages([pages], [0], [n], ps)
    backend.init_forward_metadata(prefill)
    full = backend.forward(0, q, k, v, prefill, D**-0.5)
    decode = ForwardBatch.from_pages([pages], [n - 1], [1], ps)
    backend.init_forward_metadata(decode)
    last = backend.forward(0, q[-1:], k[-1:], v[-1:], decode, D**-0.5)
    assert torch.equal(last[0], full[-1])


@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_extend_rows_equal_decode_rows(kv_dtype: str, act: torch.dtype) -> None:
    """An 8-row extend over 292 cached keys (a speculative step's verify rows: rows in the
    lanes, a block at a time) against each of its positions as a one-row decode step (a
    narrow block): the same bits row by row. (int4's rotated queries are rounded back to the
    queries' dtype, which the two paths would otherwise read differently.)"""
    n, new, ps = 300, 8, 16
    pool = _random_pool(kv_dtype, act, 8, 2, -(-n // ps), seed=61)
    pages = list(range(-(-n // ps)))
    ks, vs = pool.k_scale, pool.v_scale
    assert ks is not None and vs is not None
    scales = (ks[0], vs[0])

    def attend(q: torch.Tensor, keys: int) -> torch.Tensor:
        out = torch.full_like(q, float("nan"))
        member = native.Member(0, len(q), pages[: -(-keys // ps)], keys)
        plan = native.AttentionPlan.build([([member], [])])
        native.paged_attention(q, pool.k_data[0], pool.v_data[0], out, plan, 0.125, scales=scales)
        return out

    q = torch.randn(new, 8, D, generator=torch.Generator().manual_seed(62)).to(act)
    extend = attend(q, n)
    for i in range(new):
        assert torch.equal(attend(q[i : i + 1], n - new + i + 1)[0], extend[i])


def test_int4_pages_take_the_kernel_where_their_head_size_is_a_power_of_two() -> None:
    pool = _pool("int4", torch.bfloat16, 16, 4)
    assert pool.k_data[0].dtype == torch.uint8 and pool.k_data[0].shape[-1] == D // 2
    backend = TorchPagedAttentionBackend(pool)
    assert backend._native and backend.row_exact
    cpu = torch.device("cpu")
    assert native.supported_quantized(torch.bfloat16, torch.uint8, cpu, 128)
    assert not native.supported_quantized(torch.bfloat16, torch.uint8, cpu, 80)  # no Hadamard of 80


def test_int4_pages_of_a_head_size_not_a_power_of_two_are_refused() -> None:
    q = torch.zeros(1, 1, 96, dtype=torch.bfloat16)
    pages = torch.zeros(1, 16, 1, 48, dtype=torch.uint8)
    scales = torch.ones(1, 16, 1)
    plan = native.AttentionPlan.build([([native.Member(0, 1, [0], 1)], [])])
    with pytest.raises(RuntimeError, match="power-of-two head_dim"):
        native.paged_attention(
            q, pages, pages, torch.empty_like(q), plan, 0.1, scales=(scales, scales)
        )


def _decoded_pages(pool: KVPool, act: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's pages decoded as the torch path decodes them: code.float() * scale, rounded
    once (int4: rotated back first)."""
    assert pool.k_scale is not None and pool.v_scale is not None
    k = dequantize_ref(pool.k_data[0], pool.k_scale[0], pool.fmt).to(act)
    v = dequantize_ref(pool.v_data[0], pool.v_scale[0], pool.fmt).to(act)
    return k, v


def _assert_quantized_equals_decoded(
    pool: KVPool, q: torch.Tensor, plan: native.AttentionPlan, **kw: object
) -> None:
    """The kernel over the pool's quantized pages gives the bits of the kernel over pages of
    the queries' dtype holding the codes' decoded values (``kw``: a window, a soft-cap).
    int4, attended in the rotated basis, cannot give those bits: against the attention of
    float32 queries over the float32 decoded values, its error is at most twice theirs (the
    roundings of bf16's two bases), plus float32's few ulps of a sum in another order."""
    d = q.shape[-1]
    ks, vs = pool.k_scale, pool.v_scale
    assert ks is not None and vs is not None
    quantized, decoded = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    native.paged_attention(
        q, pool.k_data[0], pool.v_data[0], quantized, plan, d**-0.5, scales=(ks[0], vs[0]), **kw
    )
    k_dec, v_dec = _decoded_pages(pool, q.dtype)
    native.paged_attention(q, k_dec, v_dec, decoded, plan, d**-0.5, **kw)
    assert not decoded.isnan().any()
    if pool.fmt.kv_dtype.value != "int4":
        assert torch.equal(quantized, decoded)
        return
    exact = torch.full_like(q, float("nan"), dtype=torch.float32)
    k_f32, v_f32 = _decoded_pages(pool, torch.float32)
    native.paged_attention(q.float(), k_f32, v_f32, exact, plan, d**-0.5, **kw)
    err = (quantized.float() - exact).abs().max().item()
    err_decoded = (decoded.float() - exact).abs().max().item()
    assert err <= 2 * err_decoded + 5e-5, (err, err_decoded)


def _random_pool(
    kv_dtype: str,
    act: torch.dtype,
    hq: int,
    hkv: int,
    num_pages: int,
    seed: int,
    d: int = D,
    unit_scales: bool = False,
) -> KVPool:
    """A one-layer pool of 16-token pages, every slot holding random rows stored (quantized)
    through the torch store; fp8's per-head scales set apart from 1.0 but for the first head
    (its 1.0 takes the fp8-to-bf16 table), or all 1.0 with ``unit_scales``."""
    ps = 16
    pool = KVPool(1, num_pages, ps, hkv, d, kv_dtype=kv_dtype, act_dtype=act)
    if pool.fmt.kv_dtype.has_head_scales and not unit_scales:
        assert pool.k_scale is not None and pool.v_scale is not None
        pool.k_scale[0].copy_(torch.tensor([1.0, 0.5, 2.0][:hkv]))
        pool.v_scale[0].copy_(torch.tensor([1.0, 4.0, 0.25][:hkv]))
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(num_pages * ps, dtype=torch.int64)
    k = (torch.randn(len(slots), hkv, d, generator=g) * 2).to(act)
    v = torch.randn(len(slots), hkv, d, generator=g).to(act)
    ks, vs = pool.k_scale, pool.v_scale
    assert ks is not None and vs is not None
    store_kv_ref(pool.k_data[0], pool.v_data[0], ks[0], vs[0], k, v, slots, pool.fmt)
    return pool


def _skip_integer_path(kv_dtype: str, act: torch.dtype) -> None:
    """bf16 queries over int8 pages may take integer products instead of decoding the codes
    (tests/model/test_native_int8_attention.py holds that path to its own promises)."""
    if kv_dtype == "int8" and act == torch.bfloat16 and native.int8_attention_in_integers(D):
        pytest.skip("int8 pages and bf16 queries take the integer path here: no decoded values")


@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2)], ids=["9-3", "8-2"])
def test_quantized_pages_equal_their_decoded_values_bit_for_bit(
    kv_dtype: str, act: torch.dtype, heads: tuple[int, int]
) -> None:
    """The kernel over quantized pages gives the bits of the kernel over unquantized pages that
    hold the codes' decoded values, whichever way it decodes them: a block at a time for
    decode rows and short extends, each run whole once per call for the many rows of long
    extends and prefills (their own runs, and a group's shared run). 9/3 heads spread the rows
    over many work items; 8/2 with one 8-token extend leaves few (the split over chunks)."""
    _skip_integer_path(kv_dtype, act)
    hq, hkv = heads
    num_pages = 260
    pool = _random_pool(kv_dtype, act, hq, hkv, num_pages, seed=11)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(12)).tolist()

    def take(n: int) -> list[int]:
        return [perm.pop() for _ in range(n)]

    rows = 0

    def member(new: int, keys: int, have_pages: int = 0) -> native.Member:
        nonlocal rows
        m = native.Member(rows, new, take(-(-keys // 16) - have_pages), keys - have_pages * 16)
        rows += new
        return m

    if heads == (9, 3):
        shared = take(10)  # 160 keys read by a decode row, a 5-token and a 40-token extend
        groups = [
            ([member(1, 160 + 37), member(5, 160 + 70), member(40, 160 + 300)], shared),
            ([member(300, 300)], []),  # a fresh prefill
            ([member(1, 700)], []),  # a decode row
            ([member(8, 500)], []),  # a short extend: a block at a time
            ([member(30, 1100)], []),  # a long extend over a cached prefix
        ]
    else:
        groups = [([member(8, 1000)], [])]
    plan = native.AttentionPlan.build(groups)
    g = torch.Generator().manual_seed(13)
    q = torch.randn(rows, hq, D, generator=g).to(act)
    _assert_quantized_equals_decoded(pool, q, plan)


@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_windowed_quantized_pages_equal_their_decoded_values_bit_for_bit(
    kv_dtype: str, act: torch.dtype
) -> None:
    """A sliding window (and a soft-cap) over quantized pages: each row's keys start at its
    window's first, so a block of keys starts off a multiple of 64 and its decoded rows wrap
    the 64-row tile they are decoded into. The bits are those of the kernel over pages that
    hold the decoded values; every row's window and a whole page of keys before it, read."""
    _skip_integer_path(kv_dtype, act)
    window, num_pages = 100, 120
    pool = _random_pool(kv_dtype, act, HQ, HKV, num_pages, seed=21)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(22)).tolist()
    parts, rows = [], 0
    for keys, new in ((700, 1), (333, 1), (900, 40), (150, 150), (517, 12)):
        skip = max(0, keys - new - window + 1) // 16  # pages before every row's window
        pages = [perm.pop() for _ in range(-(-keys // 16) - skip)]
        parts.append(([native.Member(rows, new, pages, keys - skip * 16)], []))
        rows += new
    plan = native.AttentionPlan.build(parts)
    q = (torch.randn(rows, HQ, D, generator=torch.Generator().manual_seed(23)) * 3).to(act)
    for softcap in (None, 2.0):
        _assert_quantized_equals_decoded(pool, q, plan, window=window, softcap=softcap)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("grp", [1, 2, 3, 4])
def test_fp8_decode_rows_equal_their_decoded_values_bit_for_bit(
    kv_dtype: str, d: int, grp: int
) -> None:
    """Decode rows over fp8 pages at scale 1 with bf16 queries: where the CPU has AVX-512
    VBMI, their full blocks read the codes where they lie (csrc/paged_attention_fp8.h), every
    narrow block's row count (1-4 query heads per KV head) and head size; the bits are still
    those of the kernel over bf16 pages holding the codes' decoded values. Lengths end
    mid-block, on a block, and mid-page; one group's rows share a prefix."""
    hkv, num_pages = 2, 200
    pool = _random_pool(
        kv_dtype, torch.bfloat16, grp * hkv, hkv, num_pages, seed=31, d=d, unit_scales=True
    )
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(32)).tolist()
    shared = [perm.pop() for _ in range(12)]  # 192 keys: three full blocks
    groups, rows = [], 0
    for keys, prefix in ((700, 0), (640, 0), (1000, 0), (192 + 70, 192), (192 + 5, 192)):
        own = [perm.pop() for _ in range(-(-(keys - prefix) // 16))]
        groups.append(([native.Member(rows, 1, own, keys - prefix)], shared if prefix else []))
        rows += 1
    plan = native.AttentionPlan.build(groups)
    g = torch.Generator().manual_seed(33)
    q = (torch.randn(rows, grp * hkv, d, generator=g) * 2).to(torch.bfloat16)
    _assert_quantized_equals_decoded(pool, q, plan)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_code_decodes_to_its_bf16_value(kv_dtype: str) -> None:
    """Pages holding every finite fp8 code (zeros of both signs, subnormals, the largest),
    K and V alike, at scale 1 under bf16 queries: the decode rows' blocks read in place and
    a prefill's runs decoded whole by the byte table give the bits of the kernel over the
    codes' float values rounded to bf16 (the torch path's decoding)."""
    num_pages, hkv, d = 64, 1, 64
    pool = KVPool(1, num_pages, 16, hkv, d, kv_dtype=kv_dtype, act_dtype=torch.bfloat16)
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = codes.view(pool.k_data[0].dtype).float()
    finite = codes[values.isfinite()]
    g = torch.Generator().manual_seed(41)
    slots = num_pages * 16 * hkv * d
    for data in (pool.k_data[0], pool.v_data[0]):
        picks = finite[torch.randint(len(finite), (slots,), generator=g)]
        picks[: len(finite)] = finite  # every finite code at least once, in the first pages
        data.view(torch.uint8).copy_(picks.view(data.shape))
    ks, vs = pool.k_scale, pool.v_scale
    assert ks is not None and vs is not None
    assert bool((ks[0] == 1).all()) and bool((vs[0] == 1).all())
    rows = 0

    def member(new: int, keys: int, first_page: int) -> native.Member:
        nonlocal rows
        m = native.Member(rows, new, list(range(first_page, first_page + -(-keys // 16))), keys)
        rows += new
        return m

    plan = native.AttentionPlan.build([([member(1, 640, 0)], []), ([member(40, 320, 40)], [])])
    q = (torch.randn(rows, 3 * hkv, d, generator=g) / 64).to(torch.bfloat16)
    _assert_quantized_equals_decoded(pool, q, plan)


@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
@pytest.mark.parametrize(
    "act", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_int4_pages_of_every_head_size(d: int, act: torch.dtype) -> None:
    """int4 pages of every power-of-two head size the kernel serves, under each query dtype:
    bf16 rows of 32 codes or more decode by vector, the rest code by code; the rotation runs
    over the whole head. A decode row, a long extend (its run decoded whole) and a prefill."""
    pool = _random_pool("int4", act, 4, 2, 90, seed=51, d=d)
    perm = torch.randperm(90, generator=torch.Generator().manual_seed(52)).tolist()
    parts, rows = [], 0
    for keys, new in ((700, 1), (340, 40), (20, 20)):
        pages = [perm.pop() for _ in range(-(-keys // 16))]
        parts.append(([native.Member(rows, new, pages, keys)], []))
        rows += new
    plan = native.AttentionPlan.build(parts)
    q = torch.randn(rows, 4, d, generator=torch.Generator().manual_seed(53)).to(act)
    _assert_quantized_equals_decoded(pool, q, plan)


def test_int4_is_attention_in_the_rotated_basis_bit_for_bit() -> None:
    """What the kernel computes over int4 pages, exactly (float32 queries): the attention of
    the rotated queries over the codes' rotated values (code * scale, as float32 pages),
    rotated back; the rotations by the reference's fast transform (the kernel's own order
    of additions). Decode rows, an extend, a prefill and a shared group."""
    pool = _random_pool("int4", torch.float32, HQ, HKV, 120, seed=71)
    perm = torch.randperm(120, generator=torch.Generator().manual_seed(72)).tolist()
    shared, groups, rows = [perm.pop() for _ in range(8)], [], 0
    for keys, new, prefix in ((128 + 70, 1, 128), (128 + 90, 40, 128), (700, 1, 0), (300, 300, 0)):
        own = [perm.pop() for _ in range(-(-(keys - prefix) // 16))]
        groups.append(([native.Member(rows, new, own, keys - prefix)], shared if prefix else []))
        rows += new
    plan = native.AttentionPlan.build(groups)
    q = torch.randn(rows, HQ, D, generator=torch.Generator().manual_seed(73))
    ks, vs = pool.k_scale, pool.v_scale
    assert ks is not None and vs is not None
    out = torch.full_like(q, float("nan"))
    native.paged_attention(
        q, pool.k_data[0], pool.v_data[0], out, plan, D**-0.5, scales=(ks[0], vs[0])
    )
    k_rot = unpack_int4(pool.k_data[0]).float() * ks[0][..., None]
    v_rot = unpack_int4(pool.v_data[0]).float() * vs[0][..., None]
    rotated = torch.full_like(q, float("nan"))
    native.paged_attention(hadamard_rotate(q), k_rot, v_rot, rotated, plan, D**-0.5)
    assert torch.equal(out, hadamard_rotate(rotated))
