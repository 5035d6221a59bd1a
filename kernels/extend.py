"""Prefix-extend attention: new rows of many sequences over their cached prefix and themselves.

FlashAttention-style tiling, no attention matrix in memory, grouped query heads per KV head::

    grid (B, Hkv, ceil(max_extend_len / BLOCK_M))
    program (b, kvh, m): tokens m*BLOCK_M .. +BLOCK_M of sequence b's new rows, for all
      G = Hq/Hkv query heads of KV head kvh at once. The program's BLOCK_R score rows are
      token-major, row r = token (r // G), query head kvh*G + (r % G); BLOCK_M = BLOCK_R // G
      (any G, 9/3 = 3 included; rows past BLOCK_M*G are masked). Each K/V block is read once
      for the whole group instead of once per query head.
      Token t sits at position P0 + t (P0 = seq_len - extend_len, the cached prefix length);
      the program walks KV positions 0 .. min(seq_len, P0 + (m+1)*BLOCK_M) in BLOCK_N
      blocks, every one read from the pool through the page table (the new rows were
      stored first), keeps an online softmax, masks position > row position (causal).

Ragged lengths: programs whose token block starts past the sequence's extend length exit at
once. K/V are dequantized in-kernel (see :mod:`radixkernels._common`). Semantics:
:func:`radixkernels.reference.extend_attention_ref` (= ``paged_attention_ref``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixkernels._common import (
    LOG2E,
    MODE_INT4,
    attn_head_scales,
    attn_kv_block,
    attn_load_q,
    attn_output,
    check_attention_call,
    dot_in_fp32,
    hadamard_scale,
    head_block,
    interpreting,
    kv_dim_mask,
    kv_mode,
    sinks_log2,
)
from radixkernels.kv_format import KVFormat


@triton.jit(
    # Sliced per-step metadata (a batch's extend segment) starts at any int32 offset, and the
    # page table's row stride is the step's page count: neither may pick a compiled variant.
    do_not_specialize=["stride_pt", "window"],
    do_not_specialize_on_alignment=["pt_ptr", "seq_lens_ptr", "ext_lens_ptr", "ext_start_ptr"],
)
def _extend_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    k_ptr,
    v_ptr,
    stride_ks,
    stride_kh,
    ks_ptr,
    vs_ptr,
    pt_ptr,
    stride_pt,
    seq_lens_ptr,
    ext_lens_ptr,
    ext_start_ptr,
    o_ptr,
    stride_ot,
    stride_oh,
    qk_scale,
    window,  # the sliding window (0: none): a row sees the last ``window`` positions
    softcap2,  # the scores' soft-cap in the log2 domain (used when SOFTCAP)
    sinks2_ptr,  # [Hq] float32: each head's sink in the log2 domain (used when SINKS)
    Hkv,
    D,
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,  # score rows per program (power of two >= 16), token-major over the G heads
    BLOCK_M: tl.constexpr,  # tokens per program: BLOCK_R // G
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # covers head_dim, or head_dim // 2 for int4
    BLOCK_DF: tl.constexpr,  # covers head_dim (>= 16): int4's rotations
    HSCALE: tl.constexpr,  # int4: 1 / sqrt(head_dim)
    MODE: tl.constexpr,
    DOT_F32: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mb = tl.program_id(2)
    E = tl.load(ext_lens_ptr + b)
    if mb * BLOCK_M >= E:
        return
    L = tl.load(seq_lens_ptr + b)
    P0 = L - E
    s0 = tl.load(ext_start_ptr + b).to(tl.int64)
    if DOT_F32:
        DOT_DTYPE: tl.constexpr = tl.float32
        PREC: tl.constexpr = "ieee"
    elif MODE == 3:
        # int4: the codes are exact in fp16, where the rotated q and the scaled
        # probabilities keep 3 more bits than in bf16 (on an H200, gpu_check_s26.json, a bf16 q's
        # rotation rounded to bf16 put a peaked row 0.039 off the reference); same MMA speed.
        DOT_DTYPE: tl.constexpr = tl.float16
        PREC: tl.constexpr = "tf32"  # unused for 16-bit inputs
    else:
        DOT_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
        PREC: tl.constexpr = "tf32"  # unused for 16-bit inputs

    offs_r = tl.arange(0, BLOCK_R)
    offs_m = mb * BLOCK_M + offs_r // G  # token of each score row
    heads = kvh * G + offs_r % G  # query head of each score row
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = (offs_r < BLOCK_M * G) & (offs_m < E)
    q_pos = P0 + offs_m
    rows = s0 + offs_m
    offs_f = tl.arange(0, BLOCK_DF)
    mask_d = kv_dim_mask(offs_d, D, MODE)
    q_row_off = rows[:, None] * stride_qt + heads[:, None] * stride_qh
    q_a, q_b = attn_load_q(
        q_ptr, q_row_off, mask_m, offs_d, mask_d, offs_f, D, HSCALE, MODE, DOT_DTYPE
    )
    acc_a = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)  # int4's odd channels, else unused
    qk_scale, v_head_scale = attn_head_scales(qk_scale, ks_ptr, vs_ptr, kvh, MODE)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)

    # Masked rows (token past E, or r past BLOCK_M * G) sit at positions >= L and see all of
    # 0..L-1: no fully masked row, no NaN.
    kv_end = tl.minimum(L, P0 + (mb + 1) * BLOCK_M)
    # With a window, the blocks start at the first position the block's first row sees, and
    # each row sees only positions above its q_lo; masked rows clamp to the last position
    # read, so they still see one (no fully masked row).
    kv_start = tl.where(window > 0, tl.maximum(P0 + mb * BLOCK_M - window + 1, 0), 0)
    q_lo = tl.minimum(q_pos, kv_end - 1) - tl.where(window > 0, window, kv_end + 1)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < kv_end
        acc_a, acc_b, m_i, l_i = attn_kv_block(
            q_a,
            q_b,
            acc_a,
            acc_b,
            m_i,
            l_i,
            pos,
            mask_n,
            q_pos,
            qk_scale,
            q_lo,
            softcap2,
            pt_ptr + b.to(tl.int64) * stride_pt,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            stride_ks,
            stride_kh,
            kvh,
            Hkv,
            offs_d,
            mask_d,
            PAGE_SIZE,
            MODE,
            DOT_DTYPE,
            PREC,
            SOFTCAP,
        )

    if SINKS:  # each row's head's sink joins its denominator once, after every key
        l_i += tl.exp2(tl.load(sinks2_ptr + heads, mask=mask_m, other=0.0) - m_i)
    norm = v_head_scale / l_i
    o, offs_o = attn_output(acc_a, acc_b, offs_d, offs_f, D, HSCALE, MODE)
    out_mask = mask_m[:, None] & (offs_o < D)[None, :]
    base = o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(base + offs_o[None, :], (o * norm[:, None]).to(o_ptr.dtype.element_ty), mask=out_mask)


class ExtendBlocks(NamedTuple):
    """Launch geometry of the extend kernel for one (head group, head_dim)."""

    block_r: int  # score rows per program
    block_m: int  # tokens per program (block_r // group)
    block_n: int  # KV positions per inner step
    num_warps: int


def extend_blocks(group: int, head_dim: int) -> ExtendBlocks:
    """Geometry for ``group`` query heads per KV head: small under the interpreter so tests
    cross block edges.

    On a GPU, 128 score rows a program for every head size: a long prompt's chunk re-reads
    its whole prefix once per program, so the rows a program holds divide the prefix's
    reads (64 rows for d128 read it twice as often). The KV step is 128 keys for d <= 64
    and 64 for d128, FlashAttention-2's and Triton's Hopper tutorial's choices: the
    float32 score tile (128 x BLOCK_N) and the output (128 x d) stay within 8 warps'
    registers. Shared memory per program on sm_90, from the compiler
    (``python -m radixkernels.compile_check`` prints it; two pipeline stages): 32 KiB for
    d64 (128 x 128), 48 KiB for d128 (128 x 64), so four programs fit the 228 KB of a
    Hopper SM by shared memory (registers bind first) and any GPU since sm_80 takes the
    tile. Untimed: no GPU has run it (docs/kernels.md)."""
    if interpreting():
        rows, block_n, warps = 32, 16, 4
    else:
        rows, block_n, warps = (128, 128, 8) if head_dim <= 64 else (128, 64, 8)
    rows = max(rows, triton.next_power_of_2(group))
    return ExtendBlocks(rows, rows // group, block_n, warps)


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
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefix-extend attention of ``q`` ``[T, Hq, D]`` over each sequence's pages.

    Same signature and semantics as :func:`radixkernels.reference.extend_attention_ref`.
    ``max_extend_len`` (max of ``extend_lens``) sizes the grid; pass it from host data to
    avoid a device sync. Works for decode rows too (extend length 1). ``window``: a row
    sees only the last ``window`` positions, its own included (blocks wholly before every
    row's window are not read); ``softcap``: scores ``cap * tanh(s / cap)``; ``sinks``
    ``[Hq]``: each head's sink logit in every row's denominator (gpt-oss).
    """
    T, Hq, D = q.shape
    q, out, Hkv, stride_ks, stride_kh = check_attention_call(q, k_data, v_data, fmt, out)
    B = extend_lens.shape[0]
    if T == 0 or B == 0:
        return out
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max().item())
    mode = kv_mode(fmt)
    G = Hq // Hkv
    blocks = extend_blocks(G, D)
    dummy = k_data
    sinks2 = sinks_log2(sinks, Hq, q.device)
    grid = (B, Hkv, triton.cdiv(max_extend_len, blocks.block_m))
    _extend_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        k_data,
        v_data,
        stride_ks,
        stride_kh,
        k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy,
        page_table,
        page_table.stride(0),
        seq_lens,
        extend_lens,
        extend_start_loc,
        out,
        out.stride(0),
        out.stride(1),
        sm_scale * LOG2E,
        window or 0,
        (softcap or 1.0) * LOG2E,
        sinks2 if sinks2 is not None else dummy,
        Hkv,
        D,
        G=G,
        PAGE_SIZE=page_size,
        BLOCK_R=blocks.block_r,
        BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.block_n,
        BLOCK_D=head_block(D // 2 if mode == MODE_INT4 else D),
        BLOCK_DF=head_block(D),
        HSCALE=hadamard_scale(D),
        MODE=mode,
        DOT_F32=dot_in_fp32(q.dtype),
        SOFTCAP=softcap is not None,
        SINKS=sinks2 is not None,
        num_warps=blocks.num_warps,
        num_stages=2,
    )
    return out
