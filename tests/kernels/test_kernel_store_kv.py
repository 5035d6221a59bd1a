"""Triton store_kv against store_kv_ref: written slots, scales, and nothing else touched.

Tolerance: under the interpreter the kernel's codes are bit-exact with the reference (same
fp32 arithmetic, fp8 rounded to the grid before the cast); int4 scales may be one ulp apart,
since the Hadamard rotation's dot sums in another order than torch's matmul. Compiled on a
GPU the fp32 division may differ in the last ulp, which can flip a code on a rounding
tie, so codes may differ by one step on at most 1% of the elements.
"""

from __future__ import annotations

import kvcases
import pytest
import torch

from radixkernels import store_kv
from radixkernels.kv_format import KVFormat
from radixkernels.reference import FP8_MAX, gather_kv_ref, store_kv_ref

CASES = [
    # kv_dtype, act dtype, kv_heads, head_dim, page_size
    ("auto", torch.bfloat16, 3, 64, 4),
    ("auto", torch.float32, 2, 16, 1),
    ("int8", torch.float32, 3, 64, 1),
    ("int8", torch.bfloat16, 1, 128, 16),
    ("int4", torch.float32, 3, 64, 4),
    ("int4", torch.float16, 2, 16, 2),
    ("fp8_e4m3", torch.float32, 3, 64, 4),
    ("fp8_e4m3", torch.bfloat16, 2, 128, 1),
    ("fp8_e5m2", torch.float16, 3, 64, 8),
]


def _pools(fmt: KVFormat, num_pages: int, page_size: int, heads: int, seed: int):
    shape = (num_pages, page_size, heads, fmt.packed_head_dim)
    k_data = kvcases.poison_(torch.empty(shape, dtype=fmt.storage_dtype))
    v_data = kvcases.poison_(torch.empty(shape, dtype=fmt.storage_dtype))
    if fmt.kv_dtype.has_token_scales:
        k_scale = kvcases.poison_(torch.empty(shape[:3]))
        v_scale = kvcases.poison_(torch.empty(shape[:3]))
    elif fmt.kv_dtype.has_head_scales:
        gen = torch.Generator().manual_seed(seed)
        k_scale = 0.5 + torch.rand(heads, generator=gen)
        v_scale = 0.5 + torch.rand(heads, generator=gen)
    else:
        k_scale = v_scale = None
    return k_data, v_data, k_scale, v_scale


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _codes(raw: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """One entry per stored code: int4 bytes split into their two nibbles."""
    return torch.stack((raw & 0xF, raw >> 4), dim=-1) if kv_dtype == "int4" else raw


@pytest.mark.parametrize("kv_dtype,act,heads,head_dim,page_size", CASES)
def test_store_kv_matches_reference(
    kv_dtype: str, act: torch.dtype, heads: int, head_dim: int, page_size: int
) -> None:
    fmt = KVFormat.create(kv_dtype, act, head_dim)
    num_pages = 7
    num_slots = num_pages * page_size
    gen = torch.Generator().manual_seed(3)
    T = min(9, num_slots - 1)
    slots = torch.randperm(num_slots, generator=gen)[:T]
    # K arrives as a non-contiguous view (a slice of a fused qkv projection), V contiguous.
    fused = kvcases.random_kv((T, 3 * heads, head_dim), act, gen)
    k = fused[:, heads : 2 * heads]
    v = kvcases.random_kv((T, heads, head_dim), act, gen)
    if fmt.kv_dtype.has_head_scales:
        k[0, 0, :4] = torch.tensor(
            [1e5, -1e5, 3e-4, 2.0**-12], dtype=act
        )  # clamp + subnormal paths
    v[1, 0] = 0.0  # an all-zero row: finite scale, zero codes

    got = _pools(fmt, num_pages, page_size, heads, seed=1)
    want = _pools(fmt, num_pages, page_size, heads, seed=1)
    for g, w in zip(got, want):  # identical poison on both sides
        if g is not None:
            g.copy_(w) if g.dtype.is_floating_point else _raw(g).copy_(_raw(w))
    got = tuple(None if t is None else kvcases.dev(t) for t in got)
    store_kv(*got[:2], *got[2:], kvcases.dev(k), kvcases.dev(v), kvcases.dev(slots), fmt)
    got = tuple(None if t is None else t.cpu() for t in got)
    store_kv_ref(*want[:2], *want[2:], k, v, slots, fmt)

    written = torch.zeros(num_slots, dtype=torch.bool)
    written[slots] = True
    for name, g_data, w_data, g_scale, w_scale in (
        ("k", got[0], want[0], got[2], want[2]),
        ("v", got[1], want[1], got[3], want[3]),
    ):
        # Untouched slots keep their poison, bit for bit.
        flat_g = _raw(g_data).reshape(num_slots, -1)
        flat_w = _raw(w_data).reshape(num_slots, -1)
        g_untouched, w_untouched = flat_g[~written], flat_w[~written]
        if g_untouched.dtype.is_floating_point:
            assert torch.isnan(g_untouched).all(), f"{name}: kernel wrote outside its slots"
        else:
            assert torch.equal(g_untouched, w_untouched), f"{name}: kernel wrote outside its slots"
        # Written slots: same dequantized values up to one quantization step.
        a = gather_kv_ref(g_data, g_scale, fmt, slots)
        b = gather_kv_ref(w_data, w_scale, fmt, slots)
        assert torch.isfinite(a).all(), f"{name}: non-finite values stored"
        if fmt.kv_dtype.has_token_scales:  # one int step = the row's scale
            assert g_scale is not None and w_scale is not None
            torch.testing.assert_close(
                g_scale.view(-1, heads)[slots], w_scale.view(-1, heads)[slots], rtol=1e-6, atol=0
            )
            bound = 1.001 * w_scale.view(-1, heads)[slots][..., None].expand_as(b)
        elif fmt.kv_dtype.has_head_scales:  # one fp8 ulp, relative
            bound = 2.0 ** -(3 if kv_dtype == "fp8_e4m3" else 2) * b.abs()
        else:  # plain copy (a cast to the activation dtype it already has)
            bound = torch.zeros_like(b)
        diff = (a - b).abs()
        assert (diff <= bound + 1e-12).all(), f"{name}: stored values differ by more than one step"
        # Codes compared as codes: a scale one ulp apart (the rotation's dot sums in another
        # order than torch's matmul) moves every dequantized value of its row, not its codes.
        g_codes, w_codes = _codes(flat_g[written], kv_dtype), _codes(flat_w[written], kv_dtype)
        assert (g_codes != w_codes).float().mean() <= 0.01, f"{name}: more than 1% of codes differ"
    if fmt.kv_dtype.has_head_scales:
        kq = gather_kv_ref(
            got[0], None if got[2] is None else torch.ones_like(got[2]), fmt, slots[:1]
        )
        assert (
            float(kq[0, 0, 0]) == FP8_MAX[fmt.kv_dtype]
            and float(kq[0, 0, 1]) == -FP8_MAX[fmt.kv_dtype]
        )


def test_store_kv_empty_batch_is_a_no_op() -> None:
    fmt = KVFormat.create("int8", torch.float32, 16)
    k_data, v_data, k_scale, v_scale = (kvcases.dev(t) for t in _pools(fmt, 2, 4, 2, seed=0))
    before = k_data.clone()
    empty = kvcases.dev(torch.empty(0, 2, 16))
    store_kv(
        k_data,
        v_data,
        k_scale,
        v_scale,
        empty,
        empty,
        kvcases.dev(torch.empty(0, dtype=torch.int64)),
        fmt,
    )
    assert torch.equal(k_data, before)
