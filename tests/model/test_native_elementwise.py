"""The CPU kernels' RoPE, SiLU(gate) * up and RMSNorm against the torch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.model import native
from radixserve.model.llama import RMSNorm, RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(
    not native.load(), reason="the CPU kernels did not build here (see the log)"
)


@pytest.mark.parametrize("head_dim", [64, 16, 40, 128])  # 40: a half of 20, not whole vectors
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)]
)
def test_rotary_matches_rotate_half(head_dim: int, dtype: torch.dtype, tol: float) -> None:
    rope = RotaryEmbedding(head_dim, 10000.0, None)
    positions = torch.tensor([0, 5, 1, 900, 2047, 3])
    cos, sin = rope.cos_sin(positions, 2048, torch.float32)
    # q and k heads of a fused qkv projection: a strided view, v heads after them untouched.
    qkv = torch.randn(len(positions), 12, head_dim).to(dtype)
    want = apply_rotary(qkv[:, :10].double(), cos.double(), sin.double())
    v_before = qkv[:, 10:].clone()
    native.rotary_(qkv[:, :10], cos, sin)
    torch.testing.assert_close(qkv[:, :10].double(), want, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, 10:], v_before)


@pytest.mark.parametrize("n", [1536, 20])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)]
)
def test_silu_mul_matches_torch(n: int, dtype: torch.dtype, tol: float) -> None:
    gate_up = (torch.randn(7, 2 * n) * 6).to(dtype)  # wide range: both tails of the sigmoid
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0]).to(dtype)
    gate, up = gate_up.double().split(n, dim=-1)
    out = native.silu_mul(gate_up)
    assert out.shape == (7, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), F.silu(gate) * up, atol=tol, rtol=tol)


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, in float64 (the kernel rounds once, at the end)."""
    h = x.double()
    return w.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("n", [576, 37, 16])  # 37: no whole vector; 16: one
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 rows: split over threads
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)]
)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_transformers(
    n: int, rows: int, dtype: torch.dtype, tol: float, with_residual: bool
) -> None:
    x = (torch.randn(rows, n) * 3).to(dtype)
    w = (torch.rand(n) + 0.5).to(dtype)
    x_before = x.clone()
    if with_residual:
        res = torch.randn(rows, n).to(dtype)
        summed = res + x  # torch's add, rounded to the dtype: what the residual must hold
        out = native.rms_norm(x, w, 1e-5, res)
        assert torch.equal(res, summed)
        want = _hf_rms_norm(summed, w, 1e-5)
    else:
        out = native.rms_norm(x, w, 1e-5)
        want = _hf_rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(x, x_before)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_module_native_equals_torch_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer's norm gives the same result (to rounding) with and without the kernel,
    and leaves the residual stream identical."""
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    norm = norm.to(dtype)
    x, res = torch.randn(3, 96).to(dtype), torch.randn(3, 96).to(dtype)
    res_native = res.clone()
    got = norm(x, residual=res_native)
    monkeypatch.setattr(native, "enabled", lambda t: False)
    want = norm(x, residual=res)
    assert torch.equal(res_native, res)
    tol = 1e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_bad_arguments_raise() -> None:
    with pytest.raises(RuntimeError, match="contiguous float32"):
        native.rotary_(torch.randn(2, 3, 8), torch.randn(2, 8).double(), torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match=r"\[T, 2n\]"):
        native.silu_mul(torch.randn(4, 6).t())
    with pytest.raises(RuntimeError, match="weight must be"):
        native.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="residual must be"):
        native.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5, torch.randn(2, 8).double())
