"""The CPU kernels' RoPE and SiLU(gate) * up against the torch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.model import native
from radixserve.model.llama import RotaryEmbedding, apply_rotary

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


def test_bad_arguments_raise() -> None:
    with pytest.raises(RuntimeError, match="contiguous float32"):
        native.rotary_(torch.randn(2, 3, 8), torch.randn(2, 8).double(), torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match=r"\[T, 2n\]"):
        native.silu_mul(torch.randn(4, 6).t())
