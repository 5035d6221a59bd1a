"""The int8 weight-only GEMV (``radixkernels.int8_linear``) against torch, and Int8Linear's
CUDA path (the fused-ops switch, forced on the CPU under the interpreter) using it.

On the CPU it runs under Triton's interpreter; gpu_check.sh runs it compiled on the GPU
(``kvcases.DEVICE``), where the layer takes this path by itself.
"""

from __future__ import annotations

import kvcases
import pytest
import torch

from radixkernels.int8_gemv import int8_linear
from radixserve.model import gpu_ops
from radixserve.model.quant.formats import Int8Weight
from radixserve.model.quant.linear import CUDA_INT8_GEMV_MAX_ROWS as MAX_ROWS
from radixserve.model.quant.linear import Int8Linear

DEV = kvcases.DEVICE


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    return codes, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 48, 200), (3, 32, 128), (7, 20, 96)])
def test_int8_gemv_matches_torch(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    codes, scale = _weight(n, k, m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    want = (torch.nn.functional.linear(x.float(), codes.float()) * scale).to(dtype)
    got = int8_linear(x.to(DEV), codes.to(DEV), scale.to(dtype).to(DEV)).cpu()
    assert got.dtype == dtype and got.shape == (m, n)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(
        got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol
    )


def test_int8_layer_takes_the_gemv_on_the_cuda_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to MAX_ROWS rows the layer's CUDA path runs this kernel, not torch's int8pack."""

    def no_int8pack(*a: object, **k: object) -> torch.Tensor:
        raise AssertionError("torch._weight_int8pack_mm called on the CUDA path")

    codes, scale = _weight(32, 64, 5)
    layer = Int8Linear(Int8Weight(codes.to(DEV), scale.to(DEV)), None, torch.bfloat16, gemv=False)
    monkeypatch.setattr(torch, "_weight_int8pack_mm", no_int8pack)
    x = torch.randn(MAX_ROWS, 64).to(torch.bfloat16).to(DEV)
    with gpu_ops.forced(True), torch.inference_mode():
        y = layer(x)
        ref = layer.forward_reference(x)
    torch.testing.assert_close(
        y.float(), ref.float(), atol=2e-2 * ref.abs().max().item(), rtol=2e-2
    )
