"""KV store: write new K/V rows into the paged pool at their slots, quantizing on the way.

One program per new token handles all KV heads of K (one launch) or V (a second launch):
the row is tiny (``kv_heads x head_dim``), so the per-token absmax reduction for the
int8/int4 scales stays inside one program. Semantics: :func:`radixkernels.reference.store_kv_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkernels._common import (
    INT4_QMAX,
    INT8_QMAX,
    MODE_AUTO,
    MODE_FP8,
    MODE_INT4,
    MODE_INT8,
    QUANT_EPS,
    check_pool,
    fp8_params,
    hadamard_block,
    hadamard_scale,
    head_block,
    kv_mode,
    round_to_fp8_grid,
)
from radixkernels.kv_format import KVFormat


@triton.jit
def _store_kv_kernel(
    x_ptr,
    stride_xt,
    stride_xh,  # new rows [T, H, D] (last dim contiguous)
    slots_ptr,  # [T] int64
    data_ptr,
    stride_ds,
    stride_dh,  # pool, flat [num_slots, H, packed_head_dim]
    scale_ptr,  # int8/int4: [num_slots, H] fp32 (written); fp8: [H] fp32 (read); auto: unused
    H,
    D,
    MODE: tl.constexpr,
    QMAX: tl.constexpr,  # 127 (int8), 7 (int4), fp8 range (fp8)
    EPS: tl.constexpr,
    FP8_MBITS: tl.constexpr,
    FP8_EMIN: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= 16 for int4 (the rotation is a tl.dot)
    BLOCK_D: tl.constexpr,  # covers head_dim, or head_dim // 2 for int4
    BLOCK_DF: tl.constexpr,  # int4: covers head_dim (>= 16)
    HSCALE: tl.constexpr,  # int4: 1 / sqrt(head_dim)
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < H
    x_row = x_ptr + t.to(tl.int64) * stride_xt + offs_h[:, None] * stride_xh
    dst = data_ptr + slot * stride_ds + offs_h[:, None] * stride_dh + offs_d[None, :]
    if MODE == 3:  # int4: rotated channel 2j in the low nibble of byte j, 2j+1 in the high nibble
        mask = mask_h[:, None] & (offs_d < D // 2)[None, :]
        offs_f = tl.arange(0, BLOCK_DF)
        x = tl.load(
            x_row + offs_f[None, :], mask=mask_h[:, None] & (offs_f < D)[None, :], other=0.0
        ).to(tl.float32)
        # Rotate straight into even/odd channels: xe = x @ H[:, 0::2], xo = x @ H[:, 1::2].
        xe = tl.dot(x, hadamard_block(offs_f, 2 * offs_d, D, HSCALE), input_precision="ieee")
        xo = tl.dot(x, hadamard_block(offs_f, 2 * offs_d + 1, D, HSCALE), input_precision="ieee")
        absmax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
        scale = tl.maximum(absmax, EPS) / QMAX
        qe = tl.floor(xe / scale[:, None] + 0.5)
        qo = tl.floor(xo / scale[:, None] + 0.5)
        qe = tl.minimum(tl.maximum(qe, -QMAX), QMAX).to(tl.int32) + 8
        qo = tl.minimum(tl.maximum(qo, -QMAX), QMAX).to(tl.int32) + 8
        tl.store(dst, (qe | (qo << 4)).to(tl.uint8), mask=mask)
        tl.store(scale_ptr + slot * H + offs_h, scale, mask=mask_h)
    else:
        mask = mask_h[:, None] & (offs_d < D)[None, :]
        x = tl.load(x_row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if MODE == 2:  # int8, symmetric per (token, head)
            scale = tl.maximum(tl.max(tl.abs(x), axis=1), EPS) / QMAX
            q = tl.floor(x / scale[:, None] + 0.5)
            q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
            tl.store(dst, q.to(tl.int8), mask=mask)
            tl.store(scale_ptr + slot * H + offs_h, scale, mask=mask_h)
        elif MODE == 1:  # fp8 with the layer's static per-head scale
            hs = tl.load(scale_ptr + offs_h, mask=mask_h, other=1.0)
            y = tl.minimum(tl.maximum(x / hs[:, None], -QMAX), QMAX)
            y = round_to_fp8_grid(y, FP8_MBITS, FP8_EMIN)
            tl.store(dst, y.to(data_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(dst, x.to(data_ptr.dtype.element_ty), mask=mask)


def _store_one(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    x: torch.Tensor,
    slots: torch.Tensor,
    fmt: KVFormat,
) -> None:
    mode = kv_mode(fmt)
    stride_ds, stride_dh = check_pool(data, fmt)
    T, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if mode in (MODE_INT8, MODE_INT4):
        if (
            scale is None
            or not scale.is_contiguous()
            or scale.numel() != data.shape[0] * data.shape[1] * H
        ):
            raise ValueError(
                f"{fmt.kv_dtype.value} KV cache needs contiguous per-token scales [num_pages, page_size, {H}]"
            )
    elif mode == MODE_FP8:
        if scale is None or scale.numel() != H:
            raise ValueError(f"{fmt.kv_dtype.value} KV cache needs per-head scales [{H}]")
    fp8_max, fp8_mbits, fp8_emin = fp8_params(fmt)
    qmax = {MODE_AUTO: 1.0, MODE_FP8: fp8_max, MODE_INT8: INT8_QMAX, MODE_INT4: INT4_QMAX}[mode]
    if mode == MODE_INT4:  # the rotation is a tl.dot: every dimension >= 16
        block_h, block_d, block_df = head_block(H), head_block(D // 2), head_block(D)
    else:
        block_h, block_d, block_df = triton.next_power_of_2(H), triton.next_power_of_2(D), 16
    _store_kv_kernel[(T,)](
        x,
        x.stride(0),
        x.stride(1),
        slots,
        data,
        stride_ds,
        stride_dh,
        scale if scale is not None else data,
        H,
        D,
        MODE=mode,
        QMAX=qmax,
        EPS=QUANT_EPS,
        FP8_MBITS=fp8_mbits,
        FP8_EMIN=fp8_emin,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_DF=block_df,
        HSCALE=hadamard_scale(D),
    )


def store_kv(
    k_data: torch.Tensor,
    v_data: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    fmt: KVFormat,
) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` of one layer at pool ``slots`` ``[T]`` (int64), quantizing.

    Same signature and semantics as :func:`radixkernels.reference.store_kv_ref`.
    """
    if k.shape[0] == 0:
        return
    if slots.dtype != torch.int64:
        slots = slots.to(torch.int64)
    _store_one(k_data, k_scale, k, slots, fmt)
    _store_one(v_data, v_scale, v, slots, fmt)
