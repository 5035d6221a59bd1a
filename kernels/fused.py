"""Fused element-wise kernels of the model's layers on the GPU: RMSNorm (+ residual add),
SiLU(gate) * up, and RoPE fused with the KV store. Semantics: :mod:`radixkernels.fused_reference`.

Each kernel rounds where the torch code it replaces rounds (the model's layers in
``radixserve/model/llama.py``), so swapping one in does not move a bf16 activation by one ulp:

    rms_norm       fp32: x * rstd * w                      (torch.nn.functional.rms_norm)
                   16-bit: w * (x.float() * rstd).to(dtype) (transformers' LlamaRMSNorm)
    add_rms_norm   residual += x (rounded to the dtype), then rms_norm(residual): one pass
    silu_mul       silu(gate) rounded, then * up rounded    (F.silu(gate).mul_(up))
    rope_store_kv  q, k rotated as x * cos + rotate_half(x) * sin with each product rounded;
                   q in place, k and v written to the pool's slots (KV dtype "auto" only:
                   quantized pools keep the store kernel, which owns the scale arithmetic)

One program per token row (the rows are short: hidden size, or heads x head_dim).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkernels._common import check_pool
from radixkernels.kv_format import KVCacheDtype, KVFormat


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    stride_x,
    res_ptr,
    stride_r,
    w_ptr,
    out_ptr,
    stride_o,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_NORMED: tl.constexpr,  # 16-bit activations: round x * rstd before the weight (transformers)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    ty = x.dtype
    if HAS_RESIDUAL:
        x = (
            x.to(tl.float32)
            + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        ).to(ty)
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = xf * rstd
    if ROUND_NORMED:
        y = y.to(ty).to(tl.float32)
    y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ``[T, N]``; with ``residual``, first ``residual += x`` in place
    and normalize the sum. Returns the normalized rows (``out``, allocated when None)."""
    T, N = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(
            f"residual {tuple(residual.shape)} must match x {tuple(x.shape)} with unit inner stride"
        )
    res = residual if residual is not None else x
    _rms_norm_kernel[(T,)](
        x,
        x.stride(0),
        res,
        res.stride(0),
        weight,
        out,
        out.stride(0),
        N,
        eps,
        HAS_RESIDUAL=residual is not None,
        ROUND_NORMED=x.dtype != torch.float32,
        BLOCK=triton.next_power_of_2(N),
        num_warps=4 if N <= 4096 else 8,
    )
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, stride_gu, out_ptr, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + N + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + offs,
        (s * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[T, 2N]`` (gate first): ``[T, N]``."""
    T, N2 = gate_up.shape
    N = N2 // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    if out is None:
        out = torch.empty((T, N), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(N))
    _silu_mul_kernel[(T, triton.cdiv(N, block))](
        gate_up, gate_up.stride(0), out, out.stride(0), N, BLOCK=block
    )
    return out


@triton.jit
def _rope_store_kv_kernel(
    qkv_ptr,
    stride_t,
    stride_h,  # [T, Hq + 2 * Hkv, D], last dim contiguous
    cos_ptr,
    sin_ptr,
    stride_c,  # [T, D] (any leading view of [T, 1, D])
    slots_ptr,  # [T] int64
    k_ptr,
    v_ptr,
    stride_ks,
    stride_kh,  # pool, flat [num_slots, Hkv, D]
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= HQ + HKV
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    mask_c = offs_c < HALF
    mask = (offs_h < HQ + HKV)[:, None] & mask_c[None, :]
    row = qkv_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_c[None, :]
    x1 = tl.load(row, mask=mask, other=0.0)
    x2 = tl.load(row + HALF, mask=mask, other=0.0)
    ty = x1.dtype
    c1 = tl.load(cos_ptr + t * stride_c + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_c + HALF + offs_c, mask=mask_c, other=0.0).to(tl.float32)[
        None, :
    ]
    s1 = tl.load(sin_ptr + t * stride_c + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_c + HALF + offs_c, mask=mask_c, other=0.0).to(tl.float32)[
        None, :
    ]
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded as torch rounds them.
    o1 = ((x1f * c1).to(ty).to(tl.float32) + (-x2f * s1).to(ty).to(tl.float32)).to(ty)
    o2 = ((x2f * c2).to(ty).to(tl.float32) + (x1f * s2).to(ty).to(tl.float32)).to(ty)
    q_mask = (offs_h < HQ)[:, None] & mask_c[None, :]
    tl.store(row, o1, mask=q_mask)
    tl.store(row + HALF, o2, mask=q_mask)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    kvh = offs_h - HQ
    k_mask = (offs_h >= HQ)[:, None] & mask
    dst = slot * stride_ks + kvh[:, None] * stride_kh + offs_c[None, :]
    ety = k_ptr.dtype.element_ty
    tl.store(k_ptr + dst, o1.to(ety), mask=k_mask)
    tl.store(k_ptr + dst + HALF, o2.to(ety), mask=k_mask)
    # V heads follow the K heads in qkv: the same [BLOCK_H] rows shifted by HKV.
    v_mask = (offs_h < HKV)[:, None] & mask_c[None, :]
    vrow = qkv_ptr + t * stride_t + (HQ + HKV + offs_h)[:, None] * stride_h + offs_c[None, :]
    vdst = slot * stride_ks + offs_h[:, None] * stride_kh + offs_c[None, :]
    tl.store(v_ptr + vdst, tl.load(vrow, mask=v_mask, other=0.0).to(ety), mask=v_mask)
    tl.store(v_ptr + vdst + HALF, tl.load(vrow + HALF, mask=v_mask, other=0.0).to(ety), mask=v_mask)


def rope_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    k_data: torch.Tensor,
    v_data: torch.Tensor,
    slots: torch.Tensor,
    fmt: KVFormat,
) -> torch.Tensor:
    """Rotate the q and k heads of ``qkv`` ``[T, Hq + 2 Hkv, D]`` by ``cos``/``sin`` ``[T, 1, D]``,
    q in place; write rotated k and v to pool ``slots`` ``[T]`` (int64). Returns q ``[T, Hq, D]``
    (a view of ``qkv``). Only the ``auto`` KV format: the pool stores the activation dtype."""
    T, H, D = qkv.shape
    hkv = (H - num_q_heads) // 2
    if fmt.kv_dtype != KVCacheDtype.AUTO:
        raise ValueError(
            "rope_store_kv writes unquantized pools only; use store_kv for quantized KV"
        )
    if qkv.stride(-1) != 1 or D % 2 or num_q_heads + 2 * hkv != H or k_data.shape[-2] != hkv:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} does not hold {num_q_heads} q heads and {k_data.shape[-2]} KV heads"
        )
    stride_ks, stride_kh = check_pool(k_data, fmt)
    if check_pool(v_data, fmt) != (stride_ks, stride_kh):
        raise ValueError("K and V pools must share a layout")
    cos2, sin2 = cos.reshape(T, D), sin.reshape(T, D)
    if cos2.stride() != sin2.stride() or cos2.stride(-1) != 1:
        raise ValueError("cos and sin must share one layout with a unit inner stride")
    if T:
        _rope_store_kv_kernel[(T,)](
            qkv,
            qkv.stride(0),
            qkv.stride(1),
            cos2,
            sin2,
            cos2.stride(0),
            slots if slots.dtype == torch.int64 else slots.to(torch.int64),
            k_data,
            v_data,
            stride_ks,
            stride_kh,
            HQ=num_q_heads,
            HKV=hkv,
            HALF=D // 2,
            BLOCK_H=triton.next_power_of_2(num_q_heads + hkv),
            BLOCK_HALF=triton.next_power_of_2(D // 2),
        )
    return qkv[:, :num_q_heads]
