"""Prefix-extend attention: new rows of many sequences over their cached prefix and themselves.

FlashAttention-style tiling, no attention matrix in memory::

    grid (B, Hq, ceil(max_extend_len / BLOCK_M))
    program (b, h, m): query rows m*BLOCK_M .. +BLOCK_M of sequence b's new tokens, head h,
      at positions P0 + row (P0 = seq_len - extend_len, the cached prefix length);
      walks KV positions 0 .. min(seq_len, P0 + (m+1)*BLOCK_M) in BLOCK_N blocks, every one
      read from the pool through the page table (the new rows were stored first), keeps an
      online softmax, masks position > row position (causal on the new part).

Ragged lengths: programs whose row block starts past the sequence's extend length exit at
once. K/V are dequantized in-kernel (see :mod:`radixkernels._common`). Semantics:
:func:`radixkernels.reference.extend_attention_ref` (= ``paged_attention_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkernels._common import (
    LOG2E,
    MODE_INT4,
    check_pool,
    dot_in_fp32,
    hadamard_block,
    hadamard_scale,
    head_block,
    interpreting,
    kv_codes,
    kv_codes_int4,
    kv_mode,
)
from radixkernels.kv_format import KVFormat


@triton.jit
def _extend_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, v_ptr, stride_ks, stride_kh,
    ks_ptr, vs_ptr,
    pt_ptr, stride_pt,
    seq_lens_ptr, ext_lens_ptr, ext_start_ptr,
    o_ptr, stride_ot, stride_oh,
    qk_scale, Hkv, D,
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # covers head_dim, or head_dim // 2 for int4
    BLOCK_DF: tl.constexpr,  # covers head_dim (>= 16): int4's rotations
    HSCALE: tl.constexpr,  # int4: 1 / sqrt(head_dim)
    MODE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    E = tl.load(ext_lens_ptr + b)
    if mb * BLOCK_M >= E:
        return
    L = tl.load(seq_lens_ptr + b)
    P0 = L - E
    s0 = tl.load(ext_start_ptr + b).to(tl.int64)
    kvh = h // G
    INT4: tl.constexpr = MODE == 3
    TOKEN_SCALES: tl.constexpr = MODE >= 2
    if DOT_F32:
        DOT_DTYPE: tl.constexpr = tl.float32
        PREC: tl.constexpr = "ieee"
    else:
        DOT_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
        PREC: tl.constexpr = "tf32"  # unused for 16-bit inputs

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < E
    q_pos = P0 + offs_m
    rows = s0 + offs_m
    offs_f = tl.arange(0, BLOCK_DF)
    if INT4:
        mask_d = offs_d < D // 2
        q_off = rows[:, None] * stride_qt + h * stride_qh + offs_f[None, :]
        q = tl.load(q_ptr + q_off, mask=mask_m[:, None] & (offs_f < D)[None, :], other=0.0).to(tl.float32)
        # Rotate q into the codes' Hadamard coordinates, split into even/odd channels.
        q_e = tl.dot(q, hadamard_block(offs_f, 2 * offs_d, D, HSCALE), input_precision="ieee").to(DOT_DTYPE)
        q_o = tl.dot(q, hadamard_block(offs_f, 2 * offs_d + 1, D, HSCALE), input_precision="ieee").to(DOT_DTYPE)
        acc_e = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    else:
        mask_d = offs_d < D
        q_off = rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if MODE == 1:  # fp8: static per-head scales fold into the score scale / the output
        qk_scale = qk_scale * tl.load(ks_ptr + kvh)
        v_head_scale = tl.load(vs_ptr + kvh)
    else:
        v_head_scale = 1.0
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Rows past E sit at positions >= L and see all of 0..L-1: no fully masked row, no NaN.
    kv_end = tl.minimum(L, P0 + (mb + 1) * BLOCK_M)
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < kv_end
        page = tl.load(pt_ptr + b.to(tl.int64) * stride_pt + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
        kv_off = slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        if INT4:
            k_lo, k_hi = kv_codes_int4(k_ptr + kv_off, kv_mask, DOT_DTYPE)
            s = tl.dot(q_e, tl.trans(k_lo), input_precision=PREC)
            s += tl.dot(q_o, tl.trans(k_hi), input_precision=PREC)
        else:
            k = kv_codes(k_ptr + kv_off, kv_mask, MODE, DOT_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if TOKEN_SCALES:
            s = s * tl.load(ks_ptr + slot * Hkv + kvh, mask=mask_n, other=0.0)[None, :]
        allowed = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if TOKEN_SCALES:
            p = p * tl.load(vs_ptr + slot * Hkv + kvh, mask=mask_n, other=0.0)[None, :]
        p = p.to(DOT_DTYPE)
        if INT4:
            v_lo, v_hi = kv_codes_int4(v_ptr + kv_off, kv_mask, DOT_DTYPE)
            acc_e = acc_e * alpha[:, None] + tl.dot(p, v_lo, input_precision=PREC)
            acc_o = acc_o * alpha[:, None] + tl.dot(p, v_hi, input_precision=PREC)
        else:
            v = kv_codes(v_ptr + kv_off, kv_mask, MODE, DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m_i = m_new

    norm = v_head_scale / l_i
    if INT4:  # back from Hadamard coordinates: out = acc_e @ H[0::2, :] + acc_o @ H[1::2, :]
        o = tl.dot(acc_e, hadamard_block(2 * offs_d, offs_f, D, HSCALE), input_precision="ieee")
        o += tl.dot(acc_o, hadamard_block(2 * offs_d + 1, offs_f, D, HSCALE), input_precision="ieee")
        offs_o = offs_f
        out_mask = mask_m[:, None] & (offs_f < D)[None, :]
    else:
        o = acc
        offs_o = offs_d
        out_mask = mask_m[:, None] & mask_d[None, :]
    base = o_ptr + rows[:, None] * stride_ot + h * stride_oh
    tl.store(base + offs_o[None, :], (o * norm[:, None]).to(o_ptr.dtype.element_ty), mask=out_mask)


def _blocks(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): small under the interpreter so tests cross block edges."""
    if interpreting():
        return 16, 16, 4
    return (128, 64, 8) if head_dim <= 64 else (64, 64, 4)


def extend_attention(
    q: torch.Tensor,
    k_data: torch.Tensor,
    v_data: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    fmt: KVFormat,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    page_size: int,
    sm_scale: float,
    *,
    max_extend_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefix-extend attention of ``q`` ``[T, Hq, D]`` over each sequence's pages.

    Same signature and semantics as :func:`radixkernels.reference.extend_attention_ref`.
    ``max_extend_len`` (max of ``extend_lens``) sizes the grid; pass it from host data to
    avoid a device sync. Works for decode rows too (extend length 1).
    """
    T, Hq, D = q.shape
    Hkv = k_data.shape[-2]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    stride_ks, stride_kh = check_pool(k_data, fmt)
    if check_pool(v_data, fmt) != (stride_ks, stride_kh):
        raise ValueError("K and V pools must share a layout")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    B = extend_lens.shape[0]
    if T == 0 or B == 0:
        return out
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max().item())
    mode = kv_mode(fmt)
    block_m, block_n, warps = _blocks(D)
    dummy = k_data
    grid = (B, Hq, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, q.stride(0), q.stride(1),
        k_data, v_data, stride_ks, stride_kh,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy,
        page_table, page_table.stride(0),
        seq_lens, extend_lens, extend_start_loc,
        out, out.stride(0), out.stride(1),
        sm_scale * LOG2E, Hkv, D,
        G=Hq // Hkv, PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=head_block(D // 2 if mode == MODE_INT4 else D),
        BLOCK_DF=head_block(D), HSCALE=hadamard_scale(D),
        MODE=mode, DOT_F32=dot_in_fp32(q.dtype),
        num_warps=warps, num_stages=2,
    )
    return out
