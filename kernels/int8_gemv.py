"""int8 weight-only linear for decode-sized batches on the GPU: ``y = x @ (codes * scale).T``.

torch's CUDA ``_weight_int8pack_mm`` is a slow path at batch 1, so a decode step with an
int8 model would read its weights slower than the bf16 model's. This kernel reads the int8
codes (half the bytes of bf16) and dequantizes them in registers: each program owns
``BLOCK_N`` output channels for ``BLOCK_M`` rows and walks K in ``BLOCK_K`` steps, the
products summed in fp32 (a code times a 16-bit activation is exact in fp32), the
per-channel scale applied once at the end, as ``Int8Linear``'s reference does. Rows beyond
the layer's ``CUDA_INT8_GEMV_MAX_ROWS`` belong to a GEMM (prefill), which the layer runs on the decoded weight.

The block sizes are untuned guesses (benchmarks/gpu_int8_paths.py times this kernel against
dequantized weights and bf16 on the GPU check).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 16
BLOCK_K = 128


# M (the step's rows) is not specialized: a variant per BLOCK_M (1, 2, 4) and layer shape,
# all launched by the warm-up's and the graph capture's batch sizes.
@triton.jit(do_not_specialize=["M"])
def _int8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0,
        ).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    y = acc * s[None, :]
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[M, K]`` (16-bit or fp32), ``codes`` ``[N, K]`` int8, ``scale`` ``[N]`` ->
    ``[M, N]`` in ``x``'s dtype: fp32 sums of ``x * code``, times the channel's scale."""
    m, k = x.shape
    n = codes.shape[0]
    if codes.shape[1] != k or codes.dtype != torch.int8 or scale.shape != (n,):
        raise ValueError(
            f"int8_linear: x {tuple(x.shape)}, codes {tuple(codes.shape)} {codes.dtype}"
        )
    x = x.contiguous()
    codes = codes.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = min(4, triton.next_power_of_2(max(m, 1)))
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, block_m))
    _int8_gemv_kernel[grid](
        x,
        codes,
        scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        codes.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out
