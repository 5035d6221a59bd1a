"""Fused element-wise kernels (RMSNorm + residual, SiLU * up, RoPE + KV store) against their
torch references. They round where the references round, so fp16 agrees to its rounding;
the interpreter's fp32 -> bf16 cast truncates instead of rounding (see ARCHITECTURE.md), so
bf16 is compared within two ulps (two roundings in a row)."""

from __future__ import annotations

import kvcases
import pytest
import torch

from radixkernels.fused import rms_norm, rope_store_kv, silu_mul
from radixkernels.fused_reference import rms_norm_ref, rope_store_kv_ref, silu_mul_ref
from radixkernels.kv_format import KVFormat

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp32: summation order; fp16: the same roundings; bf16: two ulps (the interpreter truncates each of two roundings).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1.6e-2)}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 100])  # SmolLM2's hidden size; a width that is no power of two
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = kvcases.dev(torch.randn(5, n, generator=g).to(dtype))
    w = kvcases.dev((1 + 0.1 * torch.randn(n, generator=g)).to(dtype))
    _close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype)
    res = kvcases.dev(torch.randn(5, n, generator=g).to(dtype))
    res_ref = res.clone()
    out = rms_norm(x, w, 1e-5, residual=res)
    want = rms_norm_ref(x, w, 1e-5, residual=res_ref)
    _close(res, res_ref, dtype)  # residual += x, in place
    _close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    gate_up = kvcases.dev(
        (3 * torch.randn(4, 2 * 1536 + 2 * 37, generator=g)).to(dtype)
    )  # > one 1024 block, ragged
    _close(silu_mul(gate_up), silu_mul_ref(gate_up), dtype)
    _close(silu_mul(gate_up[:, :]), silu_mul_ref(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 1), 16)])
def test_rope_store_kv(dtype: torch.dtype, heads: tuple[int, int], head_dim: int) -> None:
    hq, hkv = heads
    g = torch.Generator().manual_seed(hq)
    t, num_pages, page_size = 6, 5, 4
    qkv = kvcases.dev(torch.randn(t, hq + 2 * hkv, head_dim, generator=g).to(dtype))
    ang = torch.rand(t, 1, head_dim // 2, generator=g) * 50
    cos = kvcases.dev(torch.cat((ang, ang), -1).cos().to(dtype))
    sin = kvcases.dev(torch.cat((ang, ang), -1).sin().to(dtype))
    fmt = KVFormat.create("auto", dtype, head_dim)
    pools = [
        kvcases.dev(torch.full((num_pages, page_size, hkv, head_dim), float("nan"), dtype=dtype))
        for _ in range(4)
    ]
    slots = kvcases.dev(torch.tensor([17, 0, 5, 6, 19, 9], dtype=torch.int64))
    qkv_ref = qkv.clone()
    q = rope_store_kv(qkv, cos, sin, hq, pools[0], pools[1], slots, fmt)
    q_ref = rope_store_kv_ref(qkv_ref, cos, sin, hq, pools[2], pools[3], slots, fmt)
    assert q.data_ptr() == qkv.data_ptr() and q.shape == (t, hq, head_dim)
    _close(q, q_ref, dtype)
    _close(qkv[:, hq + hkv :], qkv_ref[:, hq + hkv :], dtype)  # v untouched
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=slots.device)
    written[slots] = True
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        flat, flat_ref = got.view(-1, hkv, head_dim), want.view(-1, hkv, head_dim)
        _close(flat[written], flat_ref[written], dtype)
        assert torch.isnan(flat[~written].float()).all(), "kernel wrote outside its slots"


def test_rope_store_kv_refuses_quantized_pools() -> None:
    fmt = KVFormat.create("int8", torch.float32, 16)
    data = torch.zeros(2, 4, 1, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="unquantized"):
        rope_store_kv(
            torch.zeros(1, 6, 16),
            torch.ones(1, 1, 16),
            torch.zeros(1, 1, 16),
            4,
            data,
            data,
            torch.zeros(1, dtype=torch.int64),
            fmt,
        )
