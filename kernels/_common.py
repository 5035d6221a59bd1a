"""Pieces shared by the Triton kernels: KV-mode constants, in-kernel K/V loads, launch helpers,
and the attention steps that decode and extend share (load q, one paged K/V block with the
online-softmax update, the output).

How the attention kernels dequantize (the scales are applied outside the dot products,
which is exact in real arithmetic and keeps the inner products on raw codes)::

    auto     : codes = data                      (no scales)
    fp8      : codes = data (fp8 -> dot dtype)   scores *= k_head_scale, out *= v_head_scale
    int8     : codes = data                      scores[:, n] *= k_scale[n], p[:, n] *= v_scale[n]
    int4     : codes live in Hadamard-rotated coordinates (r = x @ H), lo/hi nibbles - 8 are the
               even/odd rotated channels. q is rotated once per program straight into its
               even/odd halves, qe = q @ H[:, 0::2], qo = q @ H[:, 1::2] (q.k = qH.kH):
               scores = qe @ lo^T + qo @ hi^T, acc_e = p @ v_lo, acc_o = p @ v_hi, and the
               output is un-rotated once at the end: out = acc_e @ H[0::2, :] + acc_o @ H[1::2, :].
               H's entries come from a formula (hadamard_block), not from memory.

Every code value (int8, int4, fp8) is exactly representable in fp16 and bf16, so casting
codes to the activation dtype for a tensor-core dot loses nothing. Under the interpreter
(and for fp32 activations) the dot runs in fp32 ("ieee"): the interpreter gets bf16 dots
wrong, and tf32 would cost accuracy the tests would then have to tolerate.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixkernels.kv_format import KVCacheDtype, KVFormat
from radixkernels.reference import FP8_MAX, INT4_OFFSET, INT4_QMAX, INT8_QMAX, QUANT_EPS

MODE_AUTO = 0
MODE_FP8 = 1
MODE_INT8 = 2
MODE_INT4 = 3

LOG2E = 1.4426950408889634

__all__ = [
    "FP8_MAX",
    "INT4_OFFSET",
    "INT4_QMAX",
    "INT8_QMAX",
    "QUANT_EPS",
    "LOG2E",
    "MODE_AUTO",
    "MODE_FP8",
    "MODE_INT8",
    "MODE_INT4",
    "kv_mode",
    "interpreting",
    "dot_in_fp32",
    "head_block",
    "check_pool",
    "AttentionCall",
    "check_attention_call",
    "kv_codes",
    "kv_codes_int4",
    "fp8_params",
    "round_to_fp8_grid",
    "hadamard_block",
    "hadamard_scale",
    "kv_tile",
    "kv_dim_mask",
    "attn_load_q",
    "attn_head_scales",
    "attn_kv_block",
    "attn_output",
]

# fp8 formats as (mantissa bits, smallest normal exponent): the grid round_to_fp8_grid rounds to.
_FP8_GRID = {KVCacheDtype.FP8_E4M3: (3, -6), KVCacheDtype.FP8_E5M2: (2, -14)}


def fp8_params(fmt: KVFormat) -> tuple[float, int, int]:
    """(range max, mantissa bits, min normal exponent) of an fp8 KV format; dummies otherwise."""
    if fmt.kv_dtype in _FP8_GRID:
        mbits, emin = _FP8_GRID[fmt.kv_dtype]
        return FP8_MAX[fmt.kv_dtype], mbits, emin
    return 1.0, 0, 0


def kv_mode(fmt: KVFormat) -> int:
    """The kernels' constexpr mode for a KV format."""
    return {
        KVCacheDtype.AUTO: MODE_AUTO,
        KVCacheDtype.FP8_E4M3: MODE_FP8,
        KVCacheDtype.FP8_E5M2: MODE_FP8,
        KVCacheDtype.INT8: MODE_INT8,
        KVCacheDtype.INT4: MODE_INT4,
    }[fmt.kv_dtype]


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_in_fp32(act_dtype: torch.dtype) -> bool:
    """Whether the attention dots upcast to fp32 (interpreter, or fp32 activations)."""
    return interpreting() or act_dtype == torch.float32


def hadamard_scale(head_dim: int) -> float:
    """``1 / sqrt(head_dim)``: the normalized Hadamard entries' magnitude (a constexpr for the kernels)."""
    return 1.0 / math.sqrt(head_dim)


def head_block(n: int) -> int:
    """Padded block size for a dimension of ``n`` elements used in ``tl.dot`` (power of two, >= 16)."""
    return max(16, triton.next_power_of_2(n))


def check_pool(data: torch.Tensor, fmt: KVFormat) -> tuple[int, int]:
    """Validate one layer's pool tensor; return its (slot stride, head stride) in elements."""
    if data.dim() != 4 or data.dtype != fmt.storage_dtype or data.shape[-1] != fmt.packed_head_dim:
        raise ValueError(
            f"pool tensor {tuple(data.shape)} {data.dtype} does not match {fmt.kv_dtype.value} "
            f"(storage {fmt.storage_dtype}, packed head dim {fmt.packed_head_dim})"
        )
    if data.stride(-1) != 1 or data.stride(0) != data.shape[1] * data.stride(1):
        raise ValueError(
            "pool tensor must have contiguous slots ([num_pages, page_size] flattenable)"
        )
    return data.stride(1), data.stride(2)


class AttentionCall(NamedTuple):
    """What the decode and extend wrappers launch with, once :func:`check_attention_call` accepts a call."""

    q: torch.Tensor  # unit stride in the head dim
    out: torch.Tensor
    kv_heads: int
    stride_slot: int  # pool strides in elements, shared by K and V
    stride_head: int


def check_attention_call(
    q: torch.Tensor,
    k_data: torch.Tensor,
    v_data: torch.Tensor,
    fmt: KVFormat,
    out: torch.Tensor | None,
) -> AttentionCall:
    """Validate an attention call's head counts and pool layouts; give q a unit-stride head dim; allocate out."""
    Hq, Hkv = q.shape[1], k_data.shape[-2]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    stride_ks, stride_kh = check_pool(k_data, fmt)
    if check_pool(v_data, fmt) != (stride_ks, stride_kh):
        raise ValueError("K and V pools must share a layout")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    return AttentionCall(q, out, Hkv, stride_ks, stride_kh)


def sinks_log2(
    sinks: torch.Tensor | None, num_q_heads: int, device: torch.device
) -> torch.Tensor | None:
    """Attention sinks (gpt-oss: one logit per query head) as the kernels take them: float32
    in the log2 domain of their scores (``sink * log2 e``), on ``device``; None: no sinks."""
    if sinks is None:
        return None
    if sinks.shape != (num_q_heads,):
        raise ValueError(
            f"sinks must hold one value per query head ({num_q_heads}), got {tuple(sinks.shape)}"
        )
    return (sinks.to(device=device, dtype=torch.float32) * LOG2E).contiguous()


@triton.jit
def kv_codes(ptrs, mask, MODE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Load a [BLOCK_N, BLOCK_D] block of K or V codes (auto/fp8/int8) in the dot dtype.

    Masked lanes read as 0. fp8 loads take no ``other`` (the interpreter cannot cast a fill
    value to fp8) and are zeroed after the conversion instead.
    """
    if MODE == 1:
        x = tl.where(mask, tl.load(ptrs, mask=mask).to(DOT_DTYPE), 0.0).to(DOT_DTYPE)
    else:
        x = tl.load(ptrs, mask=mask, other=0).to(DOT_DTYPE)
    return x


@triton.jit
def kv_codes_int4(ptrs, mask, DOT_DTYPE: tl.constexpr):
    """Load a [BLOCK_N, BLOCK_DH] block of packed int4 bytes; return (even, odd) signed codes."""
    packed = tl.load(ptrs, mask=mask, other=0x88).to(tl.int32)
    lo = (packed & 15) - 8
    hi = ((packed >> 4) & 15) - 8
    return lo.to(DOT_DTYPE), hi.to(DOT_DTYPE)


@triton.jit
def round_to_fp8_grid(y, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """Round fp32 ``y`` (already clamped to the fp8 range) to the nearest fp8 value, ties to even.

    Done in fp32 arithmetic so that the following cast only ever sees exactly representable
    values: the Triton interpreter's fp32->fp8 cast drops mantissa carries (7.99 -> 4.0 in
    e4m3), and on a GPU this matches the native round-to-nearest-even conversion.
    Subnormals share the smallest normal exponent's spacing.
    """
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
    ulp = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - e + MBITS) << 23).to(tl.float32, bitcast=True)
    z = y * inv_ulp  # exact: scaling by a power of two
    r = tl.floor(z + 0.5)
    r = tl.where(((r - z) == 0.5) & ((r.to(tl.int32) & 1) != 0), r - 1.0, r)
    return r * ulp


@triton.jit
def hadamard_block(rows, cols, D, HSCALE: tl.constexpr):
    """Entries ``H[rows, cols]`` (fp32 ``[R, C]``) of the normalized D x D Hadamard matrix, 0 outside it.

    ``H[i, j] = (-1) ** popcount(i & j) * HSCALE``, the parity folded with shifts (D <= 2**16);
    same matrix as :func:`radixkernels.reference.hadamard`.
    """
    v = rows[:, None] & cols[None, :]
    v = v ^ (v >> 8)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    sign = 1.0 - 2.0 * (v & 1).to(tl.float32)
    inside = (rows[:, None] < D) & (cols[None, :] < D)
    return tl.where(inside, sign * HSCALE, 0.0)


# ---------------------------------------------------------------------------------------------
# Attention steps shared by decode and extend. Both kernels keep their state as pairs so that
# one code path serves every KV format: for int4 the pair is (even, odd) Hadamard-rotated
# channels (q_e/q_o, acc_e/acc_o in the module docstring); for auto/fp8/int8 the first member
# holds every channel and the second is a placeholder that is never read or written (the
# compiler drops it). Triton inlines these; MODE/PAGE_SIZE/dtypes stay constexpr. MODE is
# compared as a literal (jit code cannot read the MODE_* globals): 1 fp8, 2 int8, 3 int4.
# ---------------------------------------------------------------------------------------------


@triton.jit
def kv_tile(ptrs, mask, MODE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Load a K or V tile as a pair of code blocks in the dot dtype (see the section note)."""
    if MODE == 3:  # int4
        a, b = kv_codes_int4(ptrs, mask, DOT_DTYPE)
    else:
        a = kv_codes(ptrs, mask, MODE, DOT_DTYPE)
        b = a
    return a, b


@triton.jit
def kv_dim_mask(offs_d, D, MODE: tl.constexpr):
    """Which of the ``offs_d`` columns of a pool row hold data (int4 packs 2 channels a byte)."""
    if MODE == 3:  # int4
        mask_d = offs_d < D // 2
    else:
        mask_d = offs_d < D
    return mask_d


@triton.jit
def attn_load_q(
    q_ptr,
    row_off,
    row_mask,
    offs_d,
    mask_d,
    offs_f,
    D,
    HSCALE: tl.constexpr,
    MODE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Load query rows (``row_off``: ``[R, 1]`` element offsets from ``q_ptr``) as the pair the score dots take.

    int4 rotates q once into the codes' Hadamard coordinates, split into even/odd channels.
    """
    if MODE == 3:  # int4
        q = tl.load(
            q_ptr + (row_off + offs_f[None, :]),
            mask=row_mask[:, None] & (offs_f < D)[None, :],
            other=0.0,
        ).to(tl.float32)
        q_a = tl.dot(q, hadamard_block(offs_f, 2 * offs_d, D, HSCALE), input_precision="ieee").to(
            DOT_DTYPE
        )
        q_b = tl.dot(
            q, hadamard_block(offs_f, 2 * offs_d + 1, D, HSCALE), input_precision="ieee"
        ).to(DOT_DTYPE)
    else:
        q_a = tl.load(
            q_ptr + (row_off + offs_d[None, :]), mask=row_mask[:, None] & mask_d[None, :], other=0.0
        ).to(DOT_DTYPE)
        q_b = q_a
    return q_a, q_b


@triton.jit
def tanh(x):
    """tanh from exp2 (no libdevice, so the interpreter runs it too): odd, and exact to
    ~1e-7 absolute, without overflow (the exponent is never positive)."""
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def attn_head_scales(qk_scale, ks_ptr, vs_ptr, kvh, MODE: tl.constexpr):
    """(score scale, output scale) of one KV head: fp8's static per-head scales fold in here."""
    if MODE == 1:  # fp8
        qk_scale = qk_scale * tl.load(ks_ptr + kvh)
        v_head_scale = tl.load(vs_ptr + kvh)
    else:
        v_head_scale = 1.0
    return qk_scale, v_head_scale


@triton.jit
def attn_kv_block(
    q_a,
    q_b,
    acc_a,
    acc_b,
    m_i,
    l_i,  # query pair, running output pair, row max, row sum (log2 domain)
    pos,
    mask_n,
    q_pos,
    qk_scale,  # [N] KV positions, which are in range; [R] row positions (causal) or None
    q_lo,  # [R] the position before each row's window (a window; else None)
    softcap2,  # the soft-cap in the log2 domain (cap * log2(e)), used when SOFTCAP
    pt_row,
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
    PAGE_SIZE: tl.constexpr,
    MODE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PREC: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Attend to one block of KV positions read through the page table row ``pt_row``.

    Looks up each position's slot (any page_size), loads and dequantizes K, takes the scores
    (``qk_scale`` includes log2(e)), updates the online softmax and adds P @ V to the rescaled
    accumulator. Per-token int8/int4 scales multiply score columns and P columns outside the
    dots. With ``SOFTCAP`` the scores become ``cap * tanh(score / cap)`` (Gemma 2; in the
    log2 domain, where the cap is ``softcap2``); with ``q_lo`` a row sees only positions
    above it (its sliding window). Returns the new ``(acc_a, acc_b, m_i, l_i)``; a row with
    no allowed score yet (its window starts in a later block) keeps zeros and max -inf, so
    rows must have one allowed score somewhere in the sequence (else their sum stays 0).
    """
    page = tl.load(pt_row + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + pos % PAGE_SIZE
    kv_off = slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k_a, k_b = kv_tile(k_ptr + kv_off, kv_mask, MODE, DOT_DTYPE)
    s = tl.dot(q_a, tl.trans(k_a), input_precision=PREC)
    if MODE == 3:  # int4: odd channels
        s += tl.dot(q_b, tl.trans(k_b), input_precision=PREC)
    if MODE >= 2:  # int8/int4: per-token scales
        s = s * tl.load(ks_ptr + slot * Hkv + kvh, mask=mask_n, other=0.0)[None, :]
    if q_pos is None:  # decode: the one row sits after every position
        allowed = mask_n[None, :]
    else:
        allowed = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
    if q_lo is not None:
        allowed = allowed & (pos[None, :] > q_lo[:, None])
    s = s * qk_scale
    if SOFTCAP:
        s = softcap2 * tanh(s / softcap2)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row none of whose positions so far is allowed (a window that starts past this block
    # for a later row of the block) keeps max -inf: rescale by a finite stand-in, so that
    # its alpha and p are 0 rather than exp2(-inf - -inf) = NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MODE >= 2:  # int8/int4
        p = p * tl.load(vs_ptr + slot * Hkv + kvh, mask=mask_n, other=0.0)[None, :]
    p = p.to(DOT_DTYPE)
    v_a, v_b = kv_tile(v_ptr + kv_off, kv_mask, MODE, DOT_DTYPE)
    acc_a = acc_a * alpha[:, None] + tl.dot(p, v_a, input_precision=PREC)
    if MODE == 3:  # int4
        acc_b = acc_b * alpha[:, None] + tl.dot(p, v_b, input_precision=PREC)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def attn_output(acc_a, acc_b, offs_d, offs_f, D, HSCALE: tl.constexpr, MODE: tl.constexpr):
    """(unnormalised output ``[R, BLOCK]``, its column offsets) in head coordinates.

    int4 rotates back from Hadamard coordinates: out = acc_e @ H[0::2, :] + acc_o @ H[1::2, :].
    """
    if MODE == 3:  # int4
        o = tl.dot(acc_a, hadamard_block(2 * offs_d, offs_f, D, HSCALE), input_precision="ieee")
        o += tl.dot(
            acc_b, hadamard_block(2 * offs_d + 1, offs_f, D, HSCALE), input_precision="ieee"
        )
        offs_o = offs_f
    else:
        o = acc_a
        offs_o = offs_d
    return o, offs_o
