"""Paged decode attention, flash-decoding style.

One query row per sequence attends to the sequence's whole paged history. The history is
cut into ``num_kv_splits`` chunks so that short batches of long sequences still fill the
GPU::

    stage 1  grid (B, Hkv, S): program (b, kv_head, s) walks split s of sequence b in
             BLOCK_N-token blocks (page lookups per token, so any page_size works), keeps an
             online softmax for the whole head group (G = Hq/Hkv query heads, padded to a
             power of two >= 16 so the scores are one tl.dot; padded rows are masked on store),
             and writes its normalised partial output and log-sum-exp.
    stage 2  grid (B, Hq): merges the S partials by their log-sum-exp weights.

With S == 1 stage 1 writes the output directly and stage 2 is skipped. Attention sinks
(gpt-oss: a logit per query head in every row's denominator) join once per row: in stage 1's
normalisation with S == 1, else in stage 2's merge (each partial stays normalised by its
own keys, so its log-sum-exp merges as before). K/V are
dequantized in-kernel (see :mod:`radixkernels._common`). Semantics:
:func:`radixkernels.reference.paged_decode_attention_ref`.
"""

from __future__ import annotations

import functools

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

# The page table's row stride is the step's page count, and a batch's decode segment is a
# slice of the step's rows and metadata (any offset): none of them may pick a compiled variant.
_VARYING_INTS = ["stride_pt", "window"]
_VARYING_PTRS = ["q_ptr", "o_ptr", "pt_ptr", "seq_lens_ptr"]


@triton.jit(do_not_specialize=_VARYING_INTS, do_not_specialize_on_alignment=_VARYING_PTRS)
def _decode_split_kernel(
    q_ptr,
    stride_qb,
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
    o_ptr,
    stride_ob,
    stride_oh,  # final output (NUM_SPLITS == 1) [B, Hq, D]
    mid_o_ptr,
    mid_lse_ptr,  # partials [B, Hq, NUM_SPLITS, D] / [B, Hq, NUM_SPLITS] fp32
    qk_scale,
    window,  # the sliding window (0: none): only the last ``window`` positions are read
    softcap2,  # the scores' soft-cap in the log2 domain (used when SOFTCAP)
    sinks2_ptr,  # [Hq] float32: each head's sink in the log2 domain (used when SINKS)
    Hkv,
    D,
    G: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
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
    split = tl.program_id(2)
    L = tl.load(seq_lens_ptr + b)
    lo = _window_start(L, window)  # the splits cut [lo, L): the window, or everything
    split_len = tl.cdiv(tl.cdiv(L - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, L)
    if start >= end:
        return  # an empty split: stage 2 skips it by the same arithmetic
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

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < G
    heads = kvh * G + offs_g
    offs_f = tl.arange(0, BLOCK_DF)
    mask_d = kv_dim_mask(offs_d, D, MODE)
    q_row_off = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_a, q_b = attn_load_q(
        q_ptr, q_row_off, mask_g, offs_d, mask_d, offs_f, D, HSCALE, MODE, DOT_DTYPE
    )
    acc_a = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)  # int4's odd channels, else unused
    qk_scale, v_head_scale = attn_head_scales(qk_scale, ks_ptr, vs_ptr, kvh, MODE)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        acc_a, acc_b, m_i, l_i = attn_kv_block(
            q_a,
            q_b,
            acc_a,
            acc_b,
            m_i,
            l_i,
            pos,
            mask_n,
            None,
            qk_scale,
            None,
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

    if SINKS and NUM_SPLITS == 1:  # one split holds every key: the sink joins here
        l_i += tl.exp2(tl.load(sinks2_ptr + heads, mask=mask_g, other=0.0) - m_i)
    norm = v_head_scale / l_i
    o, offs_o = attn_output(acc_a, acc_b, offs_d, offs_f, D, HSCALE, MODE)
    out_mask = mask_g[:, None] & (offs_o < D)[None, :]
    if NUM_SPLITS == 1:
        base = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
        ty = o_ptr.dtype.element_ty
    else:
        row = (b.to(tl.int64) * Hkv * G + heads) * NUM_SPLITS + split
        base = mid_o_ptr + row[:, None] * D
        ty = tl.float32
        tl.store(mid_lse_ptr + row, m_i + tl.log2(l_i), mask=mask_g)
    tl.store(base + offs_o[None, :], (o * norm[:, None]).to(ty), mask=out_mask)


@triton.jit
def _window_start(L, window):
    """The first position the decode row at ``L - 1`` sees (0 without a window)."""
    return tl.where(window > 0, tl.maximum(L - window, 0), 0)


@triton.jit(do_not_specialize=["window"], do_not_specialize_on_alignment=["o_ptr", "seq_lens_ptr"])
def _decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    stride_ob,
    stride_oh,
    seq_lens_ptr,
    window,
    sinks2_ptr,  # [Hq] float32, the log2 domain (used when SINKS)
    Hq,
    D,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    L = tl.load(seq_lens_ptr + b)
    span = L - _window_start(L, window)  # the splits' arithmetic as in stage 1
    split_len = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (offs_s < NUM_SPLITS) & (offs_s * split_len < span)
    row = (b.to(tl.int64) * Hq + h) * NUM_SPLITS + offs_s
    lse = tl.load(mid_lse_ptr + row, mask=valid, other=float("-inf"))
    top = tl.max(lse, axis=0)
    w = tl.exp2(lse - top)
    w = tl.where(valid, w, 0.0)
    parts = tl.load(
        mid_o_ptr + row[:, None] * D + offs_d[None, :],
        mask=valid[:, None] & (offs_d < D)[None, :],
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    if SINKS:  # the head's sink joins the merged denominator once
        total += tl.exp2(tl.load(sinks2_ptr + h) - top)
    o = tl.sum(w[:, None] * parts, axis=0) / total
    tl.store(
        o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
        o.to(o_ptr.dtype.element_ty),
        mask=offs_d < D,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# The split count is a compile-time constant of both stages: it takes only these values, so
# a warm-up that launches each once leaves nothing to compile while serving.
SPLIT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)


def bucket_num_kv_splits(splits: int) -> int:
    """The largest bucket in :data:`SPLIT_BUCKETS` that is <= ``splits`` (at least 1)."""
    return max(b for b in SPLIT_BUCKETS if b <= max(1, splits))


def num_kv_splits_for(batch_size: int, kv_heads: int, num_sms: int) -> int:
    """Enough splits for ~4 programs per SM, bucketed to a power of two <= 32.

    Splits past a short sequence's end exit at once, so over-splitting costs little;
    bucketing keeps the number of compiled variants at ``len(SPLIT_BUCKETS)``.
    """
    return bucket_num_kv_splits(triton.cdiv(4 * num_sms, max(1, batch_size * kv_heads)))


def device_num_sms(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device; None on the CPU or under the interpreter
    (where one split is fastest: the interpreter runs programs one after another)."""
    if device.type != "cuda" or interpreting():
        return None
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def default_num_kv_splits(batch_size: int, kv_heads: int, device: torch.device) -> int:
    """:func:`num_kv_splits_for` on a GPU; 1 on the CPU."""
    sms = device_num_sms(device)
    return 1 if sms is None else num_kv_splits_for(batch_size, kv_heads, sms)


def paged_decode_attention(
    q: torch.Tensor,
    k_data: torch.Tensor,
    v_data: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    fmt: KVFormat,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    *,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``q`` ``[B, Hq, D]`` (one row per sequence) over each sequence's pages.

    Same signature and semantics as :func:`radixkernels.reference.paged_decode_attention_ref`;
    ``seq_lens`` ``[B]`` must be >= 1, ``page_table`` ``[B, max_pages]`` int32/int64.
    ``max_seq_len`` is unused (kept for signature parity). ``num_kv_splits`` defaults to
    :func:`default_num_kv_splits` (always a :data:`SPLIT_BUCKETS` value, so warm-up covers it);
    an explicit count is taken as given. ``window``: read only the last ``window`` positions
    (the splits cut those); ``softcap``: scores ``cap * tanh(s / cap)``; ``sinks`` ``[Hq]``:
    each head's sink logit in every row's denominator. Returns ``out`` (``[B, Hq, D]``,
    ``q``'s dtype).
    """
    del max_seq_len
    B, Hq, D = q.shape
    q, out, Hkv, stride_ks, stride_kh = check_attention_call(q, k_data, v_data, fmt, out)
    G = Hq // Hkv
    if B == 0:
        return out
    mode = kv_mode(fmt)
    splits = num_kv_splits or default_num_kv_splits(B, Hkv, q.device)
    interp = interpreting()
    block_n = 16 if interp else 64
    block_d = head_block(D // 2 if mode == MODE_INT4 else D)
    if splits > 1:
        mid_o = torch.empty((B, Hq, splits, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, Hq, splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # unused
    dummy = k_data
    sinks2 = sinks_log2(sinks, Hq, q.device)
    _decode_split_kernel[(B, Hkv, splits)](
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
        out,
        out.stride(0),
        out.stride(1),
        mid_o,
        mid_lse,
        sm_scale * LOG2E,
        window or 0,
        (softcap or 1.0) * LOG2E,
        sinks2 if sinks2 is not None else dummy,
        Hkv,
        D,
        G=G,
        PAGE_SIZE=page_size,
        NUM_SPLITS=splits,
        BLOCK_G=head_block(G),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DF=head_block(D),
        HSCALE=hadamard_scale(D),
        MODE=mode,
        DOT_F32=dot_in_fp32(q.dtype),
        SOFTCAP=softcap is not None,
        SINKS=sinks2 is not None,
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        _decode_reduce_kernel[(B, Hq)](
            mid_o,
            mid_lse,
            out,
            out.stride(0),
            out.stride(1),
            seq_lens,
            window or 0,
            sinks2 if sinks2 is not None else mid_lse,
            Hq,
            D,
            NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_N=block_n,
            BLOCK_D=triton.next_power_of_2(D),
            SINKS=sinks2 is not None,
            num_warps=4,
        )
    return out
