"""Weight quantization formats: quantize and dequantize in plain torch (the references).

Every format is weight-only (the matmul multiplies full-precision activations with the
weight decoded on the fly) and keeps the rows of ``nn.Linear``'s ``[out_features,
in_features]`` weight intact, so row permutations (GGUF's q/k head order) and row slices
(fused q/k/v, gate/up) commute with quantization::

    int8  symmetric, one scale per output channel     w[n, k] = q[n, k] * s[n]             q in [-127, 127]
    int4  asymmetric, one (scale, zero) per group      w[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g]
          of ``group_size`` inputs                     (g = k // group_size)                 q in [0, 15]
    fp8   e4m3, one scale per output channel           w[n, k] = float(q[n, k]) * s[n]

The int4 zero is a float in the weight's domain ("zero point domain float", the convention
of torch's tinygemm kernels ``_weight_int4pack_mm*``): GGUF's Q4_0/Q4_1/Q4_K blocks
(``w = d * q + m``) map onto it without loss (``s = d``, ``z = m + 8 d``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 kernels accept
FP8_E4M3_MAX = 448.0


class Int8Weight(NamedTuple):
    """Per-output-channel symmetric int8: ``w = q * scale[:, None]``."""

    qweight: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # [N]


class Int4Weight(NamedTuple):
    """Group-wise asymmetric int4, codes unpacked: ``w = (q - 8) * scale + zero`` per group."""

    codes: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # [N, K // group_size]
    zero: torch.Tensor  # [N, K // group_size]
    group_size: int


class Fp8Weight(NamedTuple):
    """Per-output-channel float8 e4m3: ``w = q.float() * scale[:, None]``."""

    qweight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> Int8Weight:
    """Round-to-nearest symmetric int8 with one scale per row (absmax / 127).

    The scale is rounded to ``scale_dtype`` *before* the codes are computed, so the codes are
    the best ones for the scale the kernel will actually use.
    """
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def dequantize_int8(q: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` in ``dtype`` (computed in float32, rounded once)."""
    return (q.qweight.float() * q.scale.float()[:, None]).to(dtype)


def check_group_size(in_features: int, group_size: int) -> None:
    """Raise ``ValueError`` unless ``group_size`` is a kernel group size dividing ``in_features``."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(
            f"int4 group size {group_size} does not divide the input dimension {in_features} "
            f"(choose a group size among {[g for g in INT4_GROUP_SIZES if in_features % g == 0] or 'none'})"
        )


def quantize_int4(
    w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float32
) -> Int4Weight:
    """Round-to-nearest asymmetric int4 per group of ``group_size`` inputs (min/max range).

    ``scale = (max - min) / 15`` and codes ``round((w - min) / scale)``, as GGUF's Q4_1
    quantizer does; stored as ``zero = min + 8 * scale`` (rounded to ``scale_dtype``). The
    codes are computed against the rounded scale and zero so they suit what the kernel uses.
    """
    n, k = w.shape
    check_group_size(k, group_size)
    wg = w.detach().float().view(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12).to(scale_dtype)
    zero = (lo + 8.0 * scale.float()).to(scale_dtype)
    s, z = scale.float()[..., None], zero.float()[..., None]
    codes = torch.round((wg - z) / s + 8.0).clamp(0, 15).to(torch.uint8).view(n, k)
    return Int4Weight(codes, scale, zero, group_size)


def dequantize_int4(q: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` in ``dtype`` (computed in float32, rounded once)."""
    n, k = q.codes.shape
    g = q.group_size
    codes = q.codes.view(n, k // g, g).float().sub_(8.0)
    # addcmul over contiguous per-group scales: ~5x faster than ``codes * s + z`` (the int4
    # dense prefill path decodes every call), the same two roundings.
    scale = q.scale.float().contiguous().unsqueeze(-1)
    zero = q.zero.float().contiguous().unsqueeze(-1)
    return torch.addcmul(zero, codes, scale).view(n, k).to(dtype)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """float8 e4m3 with one float32 scale per row (absmax / 448), as vLLM's dynamic fp8."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_E4M3_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale)


def dequantize_fp8(q: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` in ``dtype``."""
    return (q.qweight.float() * q.scale.float()[:, None]).to(dtype)


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row (per-token) e4m3 quantization of activations: ``(x_fp8, scale [M, 1] fp32)``."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=1e-12)
    return (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale
