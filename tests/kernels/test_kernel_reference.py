"""The torch references against independent, obviously-correct formulations (no Triton)."""

from __future__ import annotations

import math

import kvcases
import pytest
import torch

from radixkernels.kv_format import KVFormat
from radixkernels.reference import (
    FP8_MAX,
    dequantize_ref,
    gather_kv_ref,
    hadamard,
    hadamard_rotate,
    paged_attention_ref,
    paged_decode_attention_ref,
    quantize_ref,
    unpack_int4,
)

KV_DTYPES = ["auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]


def naive_attention(
    case: kvcases.PagedCase, q: torch.Tensor, lens: list[int], exts: list[int], sm_scale: float
) -> torch.Tensor:
    """One query row at a time, K/V gathered per position, heads expanded by repeat_interleave."""
    Hq = q.shape[1]
    Hkv = case.k_data.shape[-2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    row = 0
    for b, (L, E) in enumerate(zip(lens, exts)):
        slots = case.slots_of(b, torch.arange(L))
        k = gather_kv_ref(case.k_data, case.k_scale, case.fmt, slots).repeat_interleave(
            Hq // Hkv, dim=1
        )
        v = gather_kv_ref(case.v_data, case.v_scale, case.fmt, slots).repeat_interleave(
            Hq // Hkv, dim=1
        )
        for j in range(E):
            p = L - E + j
            s = torch.einsum("hd,lhd->hl", q[row].float(), k[: p + 1]) * sm_scale
            out[row] = torch.einsum("hl,lhd->hd", s.softmax(-1), v[: p + 1])
            row += 1
    return out


@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
def test_paged_attention_ref_matches_naive(kv_dtype: str) -> None:
    lens, exts = [1, 9, 23, 6], [1, 4, 23, 2]
    case = kvcases.build_case(
        kv_dtype, torch.float32, kv_heads=3, head_dim=16, page_size=4, seq_lens=lens
    )
    q = kvcases.dev(
        kvcases.random_kv((sum(exts), 9, 16), torch.float32, torch.Generator().manual_seed(1))
    )
    starts = kvcases.dev(torch.tensor([0, 1, 5, 28], dtype=torch.int32))
    out = paged_attention_ref(
        q,
        case.k_data,
        case.v_data,
        case.k_scale,
        case.v_scale,
        case.fmt,
        case.page_table,
        case.seq_lens,
        kvcases.dev(torch.tensor(exts, dtype=torch.int32)),
        starts,
        case.page_size,
        0.25,
    )
    torch.testing.assert_close(
        out, naive_attention(case, q, lens, exts, 0.25), atol=1e-5, rtol=1e-5
    )


def test_decode_ref_equals_general_ref() -> None:
    lens = [1, 5, 17, 12]
    case = kvcases.build_case(
        "int8", torch.float32, kv_heads=2, head_dim=16, page_size=4, seq_lens=lens
    )
    q = kvcases.dev(torch.randn(4, 4, 16))
    dec = paged_decode_attention_ref(
        q,
        case.k_data,
        case.v_data,
        case.k_scale,
        case.v_scale,
        case.fmt,
        case.page_table,
        case.seq_lens,
        case.page_size,
        0.3,
    )
    gen = paged_attention_ref(
        q,
        case.k_data,
        case.v_data,
        case.k_scale,
        case.v_scale,
        case.fmt,
        case.page_table,
        case.seq_lens,
        kvcases.dev(torch.ones(4, dtype=torch.int32)),
        kvcases.dev(torch.arange(4, dtype=torch.int32)),
        case.page_size,
        0.3,
    )
    assert not torch.isnan(dec).any()
    torch.testing.assert_close(dec, gen, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantize_roundtrip_error_bounds(kv_dtype: str) -> None:
    """Each format's documented error: half a step for int, half an ulp (relative) for fp8."""
    gen = torch.Generator().manual_seed(0)
    x = kvcases.random_kv((64, 3, 32), torch.float32, gen)
    x[0] = 0.0  # an all-zero row must quantize to a finite scale and dequantize to zeros
    fmt = KVFormat.create(kv_dtype, torch.float32, 32)
    head_scale = torch.tensor([1.0, 0.5, 2.0])
    data, tok_scale = quantize_ref(x, fmt, head_scale if fmt.kv_dtype.has_head_scales else None)
    assert data.dtype == fmt.storage_dtype and data.shape[-1] == fmt.packed_head_dim
    scale = (
        tok_scale
        if fmt.kv_dtype.has_token_scales
        else (head_scale if fmt.kv_dtype.has_head_scales else None)
    )
    y = dequantize_ref(data, scale, fmt)
    assert torch.isfinite(y).all() and (y[0] == 0).all()
    err = (y - x).abs()
    if kv_dtype == "int8":
        assert tok_scale is not None and torch.isfinite(tok_scale).all()
        assert (err <= tok_scale[..., None] * 0.5 + 1e-6).all()
    elif kv_dtype == "int4":  # half a step per rotated channel; the rotation preserves L2 norms
        assert tok_scale is not None and torch.isfinite(tok_scale).all()
        assert (err.norm(dim=-1) <= tok_scale * 0.5 * math.sqrt(32) * 1.0001 + 1e-6).all()
    elif kv_dtype.startswith("fp8"):
        mbits = 3 if kv_dtype == "fp8_e4m3" else 2
        emin = -6 if kv_dtype == "fp8_e4m3" else -14
        xs = (x / head_scale[None, :, None]).abs()
        # half an ulp relative in the normal range, half the subnormal step below it
        bound = torch.maximum(
            xs * 2.0 ** (-mbits - 1), torch.full_like(xs, 2.0 ** (emin - mbits - 1))
        )
        assert (err / head_scale[None, :, None] <= bound * 1.0001).all()
    else:
        assert (err == 0).all()


@pytest.mark.parametrize("d", [1, 2, 16, 64, 256])
def test_hadamard_rotate_is_the_matrix_product_row_by_row(d: int) -> None:
    """The fast transform computes x @ H (to float32 rounding), and each row's bits are the
    same whether it is rotated alone or among others (a decode step's one row against a
    verify step's several: their int4 codes must agree)."""
    x = torch.randn(7, 3, d, generator=torch.Generator().manual_seed(d))
    rotated = hadamard_rotate(x)
    torch.testing.assert_close(rotated, x @ hadamard(d), atol=1e-5, rtol=1e-5)
    for i in range(len(x)):
        assert torch.equal(hadamard_rotate(x[i : i + 1]), rotated[i : i + 1])
    torch.testing.assert_close(hadamard_rotate(rotated), x, atol=1e-5, rtol=1e-5)  # H H = I
    with pytest.raises(ValueError, match="power of two"):
        hadamard_rotate(torch.zeros(2, 12))


def test_int4_packing_layout() -> None:
    """Rotated channel 2i in the low nibble, 2i+1 in the high nibble, stored as code + 8."""
    r = torch.tensor([[[7.0, -7.0, 0.0, 3.0]]])  # the rotated row: absmax 7 -> scale 1
    H = hadamard(4)
    assert H.tolist() == [
        [0.5, 0.5, 0.5, 0.5],
        [0.5, -0.5, 0.5, -0.5],
        [0.5, 0.5, -0.5, -0.5],
        [0.5, -0.5, -0.5, 0.5],
    ]
    x = r @ H  # H is its own inverse: x @ H == r
    fmt = KVFormat.create("int4", torch.float32, 4)
    data, scale = quantize_ref(x, fmt)
    assert scale is not None and math.isclose(float(scale), 1.0, rel_tol=1e-6)
    assert data.tolist() == [[[(7 + 8) | ((-7 + 8) << 4), (0 + 8) | ((3 + 8) << 4)]]]
    assert unpack_int4(data).tolist() == [[[7, -7, 0, 3]]]
    torch.testing.assert_close(dequantize_ref(data, scale, fmt), x)
    with pytest.raises(ValueError):
        KVFormat.create("int4", torch.float32, 48)  # not a power of two


def test_fp8_clamps_to_range() -> None:
    x = torch.tensor([[[1e6, -1e6, 1.0, 0.0]]])
    fmt = KVFormat.create("fp8_e4m3", torch.float32, 4)
    data, _ = quantize_ref(x, fmt, torch.ones(1))
    assert data.float().tolist() == [[[FP8_MAX[fmt.kv_dtype], -FP8_MAX[fmt.kv_dtype], 1.0, 0.0]]]
