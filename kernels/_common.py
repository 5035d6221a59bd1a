"""Pieces shared by the Triton kernels: KV-mode constants, in-kernel K/V loads, launch helpers.

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
    "FP8_MAX", "INT4_OFFSET", "INT4_QMAX", "INT8_QMAX", "QUANT_EPS", "LOG2E",
    "MODE_AUTO", "MODE_FP8", "MODE_INT8", "MODE_INT4",
    "kv_mode", "interpreting", "dot_in_fp32", "head_block", "check_pool", "kv_codes", "kv_codes_int4",
    "fp8_params", "round_to_fp8_grid", "hadamard_block", "hadamard_scale",
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
        raise ValueError("pool tensor must have contiguous slots ([num_pages, page_size] flattenable)")
    return data.stride(1), data.stride(2)


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
