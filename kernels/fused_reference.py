"""Plain-torch semantics of :mod:`radixkernels.fused`, same signatures (the kernels' tests compare
against these; they round exactly where the model's torch layers round)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixkernels.kv_format import KVFormat
from radixkernels.reference import store_kv_ref


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`radixkernels.fused.rms_norm` (``residual`` is updated in place)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    if x.dtype == torch.float32:
        y = F.rms_norm(x, weight.shape, weight.float(), eps)
    else:
        y = weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
    if out is not None:
        return out.copy_(y)
    return y.to(x.dtype)


def silu_mul_ref(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`radixkernels.fused.silu_mul`."""
    gate, up = gate_up.chunk(2, dim=-1)
    y = F.silu(gate).mul_(up)
    return y if out is None else out.copy_(y)


def rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' convention), in ``x``'s dtype."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_store_kv_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    k_data: torch.Tensor,
    v_data: torch.Tensor,
    slots: torch.Tensor,
    fmt: KVFormat,
) -> torch.Tensor:
    """See :func:`radixkernels.fused.rope_store_kv`."""
    hkv = (qkv.shape[1] - num_q_heads) // 2
    qk = rotate_half_ref(qkv[:, : num_q_heads + hkv], cos, sin)
    qkv[:, : num_q_heads + hkv] = qk
    store_kv_ref(
        k_data,
        v_data,
        None,
        None,
        qkv[:, num_q_heads : num_q_heads + hkv],
        qkv[:, num_q_heads + hkv :],
        slots,
        fmt,
    )
    return qkv[:, :num_q_heads]
