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
