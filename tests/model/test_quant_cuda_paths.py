"""What the quantized linears do on CUDA, shown on the CPU where CUDA's rules can be stated.

fp8's row-wise ``torch._scaled_mm`` accepts only a bf16 output on CUDA; the CPU build takes
any, so the test installs CUDA's rule around the real op: float16 activations must get the
bf16 product cast back, not an fp16 output request that CUDA rejects at the first forward.
(int8's CUDA GEMV: tests/kernels/test_int8_gemv.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.model.quant.apply import make_quantized_linear, quantize_weight
from radixserve.model.quant.linear import CUDA_INT8_GEMV_MAX_ROWS, Int8Linear


def test_fp8_with_fp16_activations_takes_a_bf16_product(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch._scaled_mm

    def cuda_rule(a: torch.Tensor, b: torch.Tensor, **kw: Any) -> torch.Tensor:
        if kw["scale_a"].numel() > 1 and kw["out_dtype"] != torch.bfloat16:
            raise RuntimeError(
                "Only bf16 high precision output types are supported for row-wise scaling."
            )
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", cuda_rule)
    torch.manual_seed(0)
    w = torch.randn(32, 64) * 0.05
    layer = make_quantized_linear(
        "fp8", quantize_weight("fp8", w, None, torch.float16), None, torch.float16
    )
    x = torch.randn(5, 64, dtype=torch.float16)
    with torch.inference_mode():
        y = layer(x)
        ref = layer.forward_reference(x)
    assert y.dtype == torch.float16 and y.shape == (5, 32)
    torch.testing.assert_close(y, ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)


def test_int8_dense_copy_serves_every_row_on_cuda_only() -> None:
    """``--quant-dense-cache`` is int8's dequantized-weights path on CUDA (every row count);
    on the CPU it keeps its crossover. The CUDA layer's own default: the GEMV up to
    ``CUDA_INT8_GEMV_MAX_ROWS`` rows, decode-then-GEMM beyond."""
    w = quantize_weight("int8", torch.randn(32, 64) * 0.05, None, torch.bfloat16)
    cpu = make_quantized_linear("int8", w, None, torch.bfloat16)
    cpu.cache_dense_weight()
    assert cpu.dense_min_rows == Int8Linear.cached_dense_min_rows > 1
    if torch.cuda.is_available():
        cuda_w = type(w)(w.qweight.cuda(), w.scale.cuda())
        layer = make_quantized_linear("int8", cuda_w, None, torch.bfloat16)
        assert layer.kernel_max_rows() == CUDA_INT8_GEMV_MAX_ROWS
        layer.cache_dense_weight()
        assert layer.dense_min_rows == 1
