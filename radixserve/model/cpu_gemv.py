"""Small-batch CPU linear kernels (``csrc/gemv.cpp``, ``csrc/gemv_int4.cpp``): load, call.

At decode row counts a linear layer is bound by reading its weight; these kernels stream
the weight once per call, decode each vector of it into registers once and multiply it
with every activation row (fp32 FMAs, or AVX-512 bf16 dot products with float32 sums).
Each output is summed in one fixed order whatever the number of rows, so a row's result
does not depend on the batch it came in (the quantized layers' exactness tests rely on it).

Where the kernels are not built (no AVX-512 bf16, no compiler, ``RADIXSERVE_CPU_KERNELS=0``)
:func:`available` is False and the layers keep their torch/oneDNN paths.
"""

from __future__ import annotations

import functools

import torch

from radixserve.model import native


@functools.cache
def available() -> bool:
    """Whether the kernels are built and supported by this CPU."""
    return native.load() and bool(torch.ops.radixserve_cpu.gemv_supported())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for contiguous ``x`` ``[M, K]`` and ``weight`` ``[N, K]`` of one
    dtype (float32 or bfloat16), summed in float32, rounded once to that dtype."""
    return torch.ops.radixserve_cpu.gemv_dense(x, weight, bias)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(x @ qweight.T) * scale`` for bfloat16 ``x`` ``[M, K]``, int8 ``qweight`` ``[N, K]``
    and bfloat16 ``scale`` ``[N]``: bfloat16 ``[M, N]``."""
    return torch.ops.radixserve_cpu.gemv_int8(x, qweight, scale)


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x @ W.T`` for bfloat16 ``x`` ``[M, K]`` and ``W = (q - 8) * scale + zero`` group-wise,
    ``packed`` from :func:`pack_int4`, ``scales_and_zeros`` bfloat16 ``[K / G, N, 2]``
    (tinygemm's layout): bfloat16 ``[M, N]``."""
    return torch.ops.radixserve_cpu.gemv_int4(x, packed, scales_and_zeros, group_size)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` (0..15, ``K`` a multiple of 32) -> the kernel's layout ``[N, K / 2]``:
    per output, chunks of 64 inputs with byte ``j`` holding inputs ``j`` (low nibble) and
    ``j + 32`` (high); a last chunk of 32 pairs ``j`` and ``j + 16``."""
    n, k = codes.shape
    if k % 32:
        raise ValueError(f"int4 packing needs in_features divisible by 32, got {k}")
    codes = codes.to(torch.uint8)
    main = k // 64 * 64
    body = codes[:, :main].reshape(n, -1, 2, 32)
    parts = [(body[:, :, 0] | body[:, :, 1] << 4).reshape(n, -1)]
    if k > main:
        tail = codes[:, main:].reshape(n, 2, 16)
        parts.append(tail[:, 0] | tail[:, 1] << 4)
    return torch.cat(parts, dim=1).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 codes ``[N, K]``."""
    n, half = packed.shape
    k = half * 2
    main = k // 64 * 64
    body = packed[:, : main // 2].reshape(n, -1, 1, 32)
    parts = [torch.cat([body & 0xF, body >> 4], dim=2).reshape(n, -1)]
    if k > main:
        tail = packed[:, main // 2 :]
        parts.append(torch.cat([tail & 0xF, tail >> 4], dim=1))
    return torch.cat(parts, dim=1).contiguous()
