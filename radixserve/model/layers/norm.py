"""RMSNorm, computed in float32 and cast back as transformers does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import gpu_ops, native


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (``size`` wide), float32 inside.

    The fused kernels (Triton on the GPU, one native pass on the CPU) take 2-D contiguous
    rows; anything else (a per-head q/k norm over a view of the fused projection) takes
    torch's ``rms_norm``, which accepts any layout.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Normalize ``x``; with ``residual``, first ``residual += x`` (in place) and normalize that."""
        flat = x.dim() == 2 and x.is_contiguous()
        if flat and gpu_ops.enabled(x):  # one Triton pass, the residual add included
            from radixkernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, residual=residual)
        if (
            flat
            and native.enabled(x)
            and self.weight.dtype == x.dtype
            and (residual is None or residual.is_contiguous())
        ):  # the add and the norm in one pass (torch's CPU rms_norm is ~6 ops)
            return native.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual.add_(x)
        # torch's fused rms_norm: one op instead of five (60 norms per decode step add up on a CPU).
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by ``1 + weight`` (the checkpoint stores the offset from 1),
    float32 inside as transformers computes it. ``1 + weight`` is formed in float32 at each
    call, not stored: in bf16 it would round to 8 mantissa bits around 1."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            x = residual.add_(x)
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), self.weight.shape, scale, self.eps).to(x.dtype)


def rms_norm(size: int, eps: float, plus_one: bool = False) -> RMSNorm:
    """The family's RMSNorm over ``size`` lanes (``plus_one``: Gemma's ``1 + weight``)."""
    return OffsetRMSNorm(size, eps) if plus_one else RMSNorm(size, eps)


def stack_weight(norm: RMSNorm) -> torch.Tensor:
    """What the one-call CPU decoder stack scales ``norm``'s output by: Gemma's float32
    ``1 + weight``, formed as :meth:`OffsetRMSNorm.forward` forms it (the same bits, once,
    not per call), or the weight itself."""
    if isinstance(norm, OffsetRMSNorm):
        return 1.0 + norm.weight.detach().float()
    return norm.weight.detach()


def scale_normed(norm: RMSNorm, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``normed`` (float32, already divided by its RMS) scaled by ``norm``'s weight and cast to
    ``dtype`` as ``norm.forward`` does (a norm whose RMS was summed over tensor-parallel ranks)."""
    if isinstance(norm, OffsetRMSNorm):
        return (normed * (1.0 + norm.weight.float())).to(dtype)
    if dtype == torch.float32:
        return normed * norm.weight
    return norm.weight * normed.to(dtype)
