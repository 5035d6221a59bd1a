"""Quantized linear layers: int8 and int4 weight-only kernels on the CPU, ``_scaled_mm`` (fp8).

Which kernels (measured on the project's 2-core AVX-512 VM, SmolLM2 shapes,
``benchmarks/bench_quant.py --layer-rows``):

- int8 on the CPU: :mod:`radixserve.model.cpu_gemv`'s kernel (``gemv_int8``), on its own
  layout (``pack_int8``: codes of 16 outputs x a pair of inputs side by side). It multiplies
  in a GEMM's outer-product form: each 32 bytes decode exactly to one bf16 vector that serves
  a register block of up to 6 rows, each row's pair of inputs broadcast, float32 sums, the
  per-channel scale applied after (past 6 rows from a decoded L1 panel). Against the
  row-major kernel it replaced, over the 120 int8 linears of SmolLM2 (weights from memory,
  both in one process, ``bench_int8_kernel.py``; benchmarks/README.md): 1.02-1.27x the time at
  1 row, 0.77-0.91x at 2-16 rows, ~0.7x at 32. torch's ``_weight_int8pack_mm`` (what
  torchao's CPU int8 layout calls too) decodes the weight to float32 again for every row
  (~45 us per row per SmolLM2 layer). On CUDA (where torch's int8pack is a slow path at
  batch 1) a Triton GEMV that dequantizes in registers (``radixkernels.int8_gemv``) up to
  ``CUDA_INT8_GEMV_MAX_ROWS`` rows, or with ``--quant-dense-cache`` the decoded weight for
  every row count; where cpu_gemv is not built, torch's kernel.
- int4 on the CPU: cpu_gemv's int4 kernel (``gemv_int4``, its own layout from ``pack_int4``:
  nibbles in tiles of 4 outputs, inputs reordered so that each float lane of the bf16 dot
  products stays on one group and the group scales apply once per 16 groups). At decode row
  counts it streams the weight faster than torch's tinygemm (``_weight_int4pack_mm_for_cpu``)
  on SmolLM2's shapes (``benchmarks/bench_int4_gemv.py``; docs/quantization.md has the
  figures) and, like the int8 kernel, sums each row on its own. Where cpu_gemv is not built,
  tinygemm; on CUDA ``_weight_int4pack_mm``.

The int4 kernel is GEMV-shaped (its cost grows with the rows): past ~128 rows (prefill
chunks) decoding the weight once into a bf16 matrix and calling the BLAS GEMM is faster;
int8's kernel stays ahead of that up to ~576 rows. ``INT4_DEQUANT_MIN_ROWS`` and
``DEQUANT_MIN_ROWS`` are the crossovers.
Decode batches (the graphs a GPU captures) stay on the packed kernels. Opt-in
``--quant-dense-cache`` (``cache_dense_weight``) keeps the weight decoded to bf16 and
pre-packed for oneDNN as well, for batches from ``cached_dense_min_rows`` rows: oneDNN
bf16's speed there, at 2 more bytes per quantized weight (more memory than the bf16 model
itself; a choice for speed, not for memory).

That dense path multiplies by the weight decoded to bf16, one more rounding of every
weight (at most 2^-9 relative) than the kernels, which apply the scales in float32.

Every layer keeps ``forward_reference``: dequantize-then-matmul in float32 on the same
bf16 activations for the kernels' row counts (for the dense path's, that path itself): the
oracle the tests and ``reference=True`` runs compare against. The packed kernels compute
each row on its own (cpu_gemv sums each output in an order that does not depend on the
row count), so with every row count on them (``dense_min_rows``) a model's output for a
token does not depend on the batch or chunk it came in: tests/model/test_quant_exact.py
holds a batched, chunked engine to a whole-sequence reference bit for bit.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import cpu_gemv, gpu_ops
from radixserve.model.cpu_linear import onednn_linear, onednn_linear_supported
from radixserve.model.quant.formats import (
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    fp8_quantize_rows,
)

# Rows from which decoding the weight and running the dense GEMM beats the packed kernel
# (CPU, int8). The kernel multiplies in the outer-product form, which reaches ~90 % of
# oneDNN's bf16 GEMM at a few hundred rows; the dense path pays a native decode (~200 us per
# SmolLM2 layer, writing 7 MB) and a GEMM on an unpacked weight: crossover near 576 rows
# (2026-12-02, ``bench_quant.py --layer-rows``: 5404 against 5609 us at 512, 9367 against
# 8583 at 768).
DEQUANT_MIN_ROWS = 576
# int4's dense path decodes natively too (``cpu_gemv.int4_dequantize``, ~0.6 ms per SmolLM2
# layer); against cpu_gemv's int4 kernel (~18 us per row per layer) the crossover is near
# 112 rows (2026-12-02, ``bench_quant.py --layer-rows 64,96,128,160,192,256 --configs int4``:
# 1952 against 1840 us at 96 rows, 2306 against 2474 at 128, 3704 against 5527 at 256).
INT4_DEQUANT_MIN_ROWS = 128
INT4_TINYGEMM_DEQUANT_MIN_ROWS = 256  # where tinygemm serves int4 (cpu_gemv not built)
# With a decoded copy kept (``--quant-dense-cache``), rows from which its oneDNN bf16 GEMM
# beats the packed kernel: from 4 rows for int4 (its kernel ~18 us per row per SmolLM2 layer,
# the GEMM nearly flat up to 16 rows), from ~128 for int8, whose kernel keeps up with the GEMM
# until then (2026-12-02, ``bench_quant.py --layer-rows``: 726-755 against 760-801 us at 64
# rows, 1311-1533 against 1271-1468 at 128).
CACHED_DENSE_MIN_ROWS = 4
INT8_CACHED_DENSE_MIN_ROWS = 128
# int8 on CUDA: rows up to which the Triton GEMV (radixkernels.int8_gemv) serves; more rows
# decode the weight and run the GEMM. The first GPU run (docs/kernels.md, one H200) timed the
# GEMV slower than bf16 at 1 row and far slower at 16; --quant-dense-cache ran as bf16 did.
CUDA_INT8_GEMV_MAX_ROWS = 16
# What fp8's row-wise scaled GEMM writes (CUDA accepts nothing else with row-wise scales).
FP8_OUT_DTYPE = torch.bfloat16
# kernel_max_rows of a layer whose packed kernel serves every row count.
UNLIMITED_ROWS = 1 << 30
# oneDNN picks its blocking of a pre-packed weight for this many activation rows.
_ONEDNN_ROWS_HINT = 16
# The CPU int4 kernel's layout: blocks of this many output rows, byte j of a block's k-th
# 32-byte slab holds row j (low nibble) and row j + 32 (high nibble); a last block of fewer
# rows pairs rows 2j and 2j + 1 instead. Checked on every layer's own weight at load.
_CPU_INT4_BLOCK_N = 64


def compute_dtype_for(device: torch.device, act_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the weight-only kernels multiply in on ``device``."""
    if device.type == "cuda" and act_dtype in (torch.float16, torch.bfloat16):
        return act_dtype
    return torch.bfloat16


class QuantizedLinear(nn.Module):
    """Base of the quantized linears: ``y = x @ dequant(W).T + b`` with ``W`` stored quantized.

    Subclasses hold their quantized weight as buffers and implement ``_matmul`` (the fast
    kernel) and ``dequantize`` (the exact decoded weight). ``reference = True`` routes the
    forward through ``forward_reference`` instead of the kernel.
    """

    method: ClassVar[str]
    # Rows from which a kept decoded copy (cache_dense_weight) multiplies instead of the kernel.
    cached_dense_min_rows: ClassVar[int] = CACHED_DENSE_MIN_ROWS

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.compute_dtype = compute_dtype
        self.reference = False
        # From this many rows on, decode the weight and run the dense GEMM (see the module
        # docstring); a larger value keeps every row count on the packed kernel, whose rows
        # do not depend on each other (what an exactly reproducible reference run needs).
        self.dense_min_rows = self.default_dense_min_rows = DEQUANT_MIN_ROWS
        # Opt-in decoded copy of the weight (cache_dense_weight): None, or the weight in
        # compute_dtype, oneDNN-packed on the CPU.
        self.dense_cache: torch.Tensor | None = None
        self.dense_cache_bytes = 0
        self._dense_cache_onednn = False
        # Speculative decoding (cpu_linear.RowInvariantLinears): one forward's rows for the
        # packed kernel at any count, and rows whose count picks the path; or None.
        self.row_split: tuple[torch.Tensor, torch.Tensor] | None = None

    @abstractmethod
    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` in ``compute_dtype`` -> ``[M, N]`` in ``compute_dtype``, no bias."""

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer multiplies with, decoded: ``[N, K]`` in ``dtype``."""

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """The activation exactly as the kernel sees it."""
        return x.to(self.compute_dtype)

    def kernel_max_rows(self) -> int:
        """Rows up to which ``_matmul`` runs the packed kernel (more: decode-then-GEMM). Read
        at call time: ``dense_min_rows`` and a decoded copy can change it."""
        return self.dense_min_rows - 1

    def _dense_path(self, rows: int) -> bool:
        """Whether ``rows`` rows take the decode-then-GEMM path instead of the packed kernel."""
        return rows > self.kernel_max_rows()

    def cache_dense_weight(self, min_rows: int | None = None) -> int:
        """Keep the weight decoded to ``compute_dtype`` (oneDNN-packed on the CPU) and multiply
        batches of ``min_rows`` rows or more with it (None: the method's
        ``cached_dense_min_rows``); returns the bytes this copy costs."""
        if min_rows is None:
            min_rows = self.cached_dense_min_rows
        w = self.dequantize(self.compute_dtype)
        self._dense_cache_onednn = w.device.type == "cpu" and onednn_linear_supported(w.dtype)
        self.dense_cache = (
            torch.ops.mkldnn._reorder_linear_weight(w, _ONEDNN_ROWS_HINT)
            if self._dense_cache_onednn
            else w
        )
        self.dense_cache_bytes = w.numel() * w.element_size()
        self.dense_min_rows = self.default_dense_min_rows = min_rows
        return self.dense_cache_bytes

    def onednn_weight(self) -> tuple[torch.Tensor, None] | None:
        """The oneDNN-packed decoded weight, where one is kept (for ``cpu_linear.warm_onednn``)."""
        if self.dense_cache is None or not self._dense_cache_onednn:
            return None
        return self.dense_cache, None

    def _dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The dense path: the decoded weight's GEMM (the kept copy, or decoded on the spot)."""
        if self.dense_cache is None:
            return F.linear(x, self.dequantize(self.compute_dtype))
        if self._dense_cache_onednn:
            return onednn_linear(x, self.dense_cache)
        return F.linear(x, self.dense_cache)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reference:
            return self.forward_reference(x)
        lead = x.shape[:-1]
        x2 = self._activation(x.reshape(-1, self.in_features))
        y = (self._matmul(x2) if self.row_split is None else self._split(x2)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """``row_split``'s first rows on the packed kernel whatever their count (it computes
        each row on its own: a verify row gets a one-row decode's bits), the others on the
        path their own count picks (a prefill chunk's, as alone)."""
        assert self.row_split is not None
        kernel_rows, other_rows = self.row_split
        y = x.new_empty(x.shape[0], self.out_features)
        saved, self.dense_min_rows = self.dense_min_rows, UNLIMITED_ROWS
        try:
            y.index_copy_(0, kernel_rows, self._matmul(x.index_select(0, kernel_rows)))
        finally:
            self.dense_min_rows = saved
        y.index_copy_(0, other_rows, self._matmul(x.index_select(0, other_rows)))
        return y

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize-then-matmul in float32 on the kernel's activations, rounded like its output."""
        lead = x.shape[:-1]
        xa = self._activation(x.reshape(-1, self.in_features)).float()
        if self._dense_path(xa.shape[0]):  # the fast path is dequantize-then-matmul already
            y = F.linear(xa.to(self.compute_dtype), self.dequantize(self.compute_dtype)).to(x.dtype)
        else:
            y = self._reference_matmul(xa).to(self.compute_dtype).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)

    def _reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``x @ dequant(W).T`` for the kernels' row counts (float32 ``x``)."""
        return F.linear(x, self.dequantize(torch.float32))

    def weight_bytes(self) -> int:
        """Bytes of the quantized weight, its scales and any decoded copy (the bias excluded)."""
        return sum(b.numel() * b.element_size() for b in self.buffers()) + self.dense_cache_bytes

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{self.method}, compute={str(self.compute_dtype).removeprefix('torch.')}"
        )


class Int8Linear(QuantizedLinear):
    """int8 weight-only, per-output-channel scales. On the CPU :mod:`cpu_gemv`'s int8 kernel,
    the codes in its block layout (``pack_int8``), where it is built; elsewhere torch's
    ``_weight_int8pack_mm`` on the codes ``[N, K]``."""

    method = "int8"
    cached_dense_min_rows = INT8_CACHED_DENSE_MIN_ROWS
    # Buffers (registered in __init__), declared for the type checker.
    qweight: torch.Tensor  # the codes in the layout the layer's kernel reads (see codes())
    scale: torch.Tensor

    def __init__(
        self,
        w: Int8Weight,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype = torch.bfloat16,
        gemv: bool | None = None,
    ):
        """``gemv``: use cpu_gemv's kernel on the CPU (None: wherever it is available)."""
        n, k = w.qweight.shape
        super().__init__(k, n, bias, compute_dtype)
        # On the CPU: cpu_gemv's kernel (each vector of codes decoded once per call, for
        # every row), on its block layout.
        self.gemv = (
            gemv is not False
            and w.qweight.device.type == "cpu"
            and compute_dtype is torch.bfloat16
            and cpu_gemv.int8_packable(n, k)
            and cpu_gemv.available()
        )
        codes = w.qweight.contiguous()
        self.register_buffer("qweight", cpu_gemv.pack_int8(codes) if self.gemv else codes)
        self.register_buffer("scale", w.scale.to(compute_dtype).contiguous())
        if codes.is_cuda:  # decode rows: the Triton GEMV; more rows: decode, then the GEMM
            self.dense_min_rows = self.default_dense_min_rows = CUDA_INT8_GEMV_MAX_ROWS + 1

    def cache_dense_weight(self, min_rows: int | None = None) -> int:
        """On CUDA the kept decoded weight serves every row count (``--quant-dense-cache``:
        the dequantized-weights alternative to the Triton GEMV, bf16's speed for 2 bytes more
        per weight)."""
        if min_rows is None and self.qweight.is_cuda:
            min_rows = 1
        return super().cache_dense_weight(min_rows)

    def codes(self) -> torch.Tensor:
        """The int8 codes ``[N, K]`` (``qweight`` itself unless it is in cpu_gemv's layout)."""
        return cpu_gemv.unpack_int8(self.qweight, self.out_features) if self.gemv else self.qweight

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense_path(x.shape[0]):
            return self._dense_matmul(x)
        if self.gemv:
            return cpu_gemv.int8_linear(x.contiguous(), self.qweight, self.scale)
        if gpu_ops.enabled(x):  # CUDA: torch's int8pack is a slow path at decode batch sizes
            from radixkernels.int8_gemv import int8_linear

            return int8_linear(x, self.qweight, self.scale)
        if x.device.type == "cpu" and self.in_features % 2:
            # torch's CPU kernel crashes on an odd number of inputs (torch 2.13), which
            # cpu_gemv's layout does not take either: the reference matmul, slow but right.
            return self._reference_matmul(x.float()).to(self.compute_dtype)
        return torch._weight_int8pack_mm(x, self.qweight, self.scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if dtype == self.scale.dtype == torch.bfloat16:
            # The dense path's decode, the same bits as through float32: a code is exact in
            # bf16, and bf16 * bf16 is the exact product rounded once. Natively in one pass
            # where cpu_gemv is built (~3x torch's two).
            if self.gemv:
                return cpu_gemv.int8_dequantize(self.qweight, self.scale)
            return self.qweight.to(dtype) * self.scale[:, None]
        return dequantize_int8(Int8Weight(self.codes(), self.scale), dtype)

    def _reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        # The per-channel scale factors out of the sum: applying it after the float32 dot
        # products is the same math in the kernel's order, so both round alike.
        return F.linear(x, self.codes().float()) * self.scale.float()


def _int4_inner_k_tiles(k: int) -> int:
    """The CUDA tinygemm layout's K tiling (K must be a multiple of ``tiles * 16``)."""
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"int4 on CUDA needs in_features divisible by 32, got {k}")


def unpack_cpu_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes ``[N, K]`` (uint8) from ``_convert_weight_to_int4pack_for_cpu``'s layout."""
    out = torch.empty(n, k, dtype=torch.uint8, device=packed.device)
    flat = packed.reshape(-1)
    full, half = n // _CPU_INT4_BLOCK_N * _CPU_INT4_BLOCK_N, _CPU_INT4_BLOCK_N // 2
    if full:  # every whole block at once: [blocks, K, 32] bytes -> rows j and j + 32
        blk = flat[: full * k // 2].view(-1, k, half).transpose(1, 2)
        out[:full].view(-1, _CPU_INT4_BLOCK_N, k).copy_(torch.cat([blk & 0xF, blk >> 4], dim=1))
    nb = n - full
    if nb:  # the last, partial block pairs rows 2j and 2j + 1
        blk = flat[full * k // 2 : full * k // 2 + k * nb // 2].view(k, nb // 2)
        out[full:] = torch.stack([(blk & 0xF).t(), (blk >> 4).t()], dim=1).reshape(nb, k)
    return out


class Int4Linear(QuantizedLinear):
    """int4 weight-only, group-wise scale and zero. On the CPU :mod:`cpu_gemv`'s int4 kernel
    (its own layout, ``pack_int4``) where it is built, else torch's tinygemm kernel
    (``_weight_int4pack_mm_for_cpu``); on CUDA tinygemm's ``_weight_int4pack_mm``."""

    method = "int4"
    packed: torch.Tensor  # buffers (registered in __init__)
    scales_and_zeros: torch.Tensor

    def __init__(
        self,
        w: Int4Weight,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype = torch.bfloat16,
        gemv: bool | None = None,
    ):
        """``gemv``: use cpu_gemv's kernel on the CPU (None: wherever it is available)."""
        n, k = w.codes.shape
        super().__init__(k, n, bias, compute_dtype)
        if n % 16:
            raise ValueError(f"int4 kernels need out_features divisible by 16, got {n}")
        self.group_size = w.group_size
        # Not `self.cuda`: that would hide nn.Module.cuda() on this layer.
        self.on_cuda = w.codes.device.type == "cuda"
        usable = not self.on_cuda and compute_dtype is torch.bfloat16 and cpu_gemv.available()
        self.gemv = usable if gemv is None else gemv and usable
        self.dense_min_rows = self.default_dense_min_rows = (
            INT4_DEQUANT_MIN_ROWS if self.gemv else INT4_TINYGEMM_DEQUANT_MIN_ROWS
        )
        if self.on_cuda:
            if compute_dtype is not torch.bfloat16:
                raise ValueError("int4 on CUDA multiplies in bfloat16 only")
            nibbles = (w.codes[:, ::2] << 4 | w.codes[:, 1::2]).contiguous()
            packed = torch._convert_weight_to_int4pack(nibbles, _int4_inner_k_tiles(k))
        elif self.gemv:
            packed = cpu_gemv.pack_int4(w.codes, w.group_size)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32), 1)
        self.register_buffer("packed", packed)
        # cpu_gemv: [N, 2, K / group]; tinygemm: [K / group, N, 2].
        self.register_buffer("scales_and_zeros", self._layout_scales_zeros(w.scale, w.zero))
        # The dense prefill path unpacks the codes itself: only when the layout is the one
        # we know (verified on this very weight), otherwise every row count uses the kernel.
        self.cpu_layout_known = self.gemv or (
            not self.on_cuda and torch.equal(unpack_cpu_int4(packed, n, k), w.codes)
        )

    def _layout_scales_zeros(self, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Scales and zeros ``[N, K / group]`` each in the kernel's layout and dtype."""
        if self.gemv:
            return cpu_gemv.int4_scales_zeros(scale, zero)
        return torch.stack([scale.t(), zero.t()], dim=-1).to(self.compute_dtype).contiguous()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense_path(x.shape[0]):
            return self._dense_matmul(x)
        if self.gemv:
            return cpu_gemv.int4_linear(
                x.contiguous(), self.packed, self.scales_and_zeros, self.group_size
            )
        if self.on_cuda:
            return torch._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)
        return torch._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scales_and_zeros
        )

    def kernel_max_rows(self) -> int:
        if self.cpu_layout_known or self.dense_cache is not None:
            return self.dense_min_rows - 1
        return UNLIMITED_ROWS  # no dense path: every row count takes the kernel

    def int4_weight(self) -> Int4Weight:
        """The codes, scales and zeros this layer multiplies with."""
        sz = self.scales_and_zeros
        scale, zero = (sz[:, 0], sz[:, 1]) if self.gemv else (sz[..., 0].t(), sz[..., 1].t())
        if self.cpu_layout_known:
            if self.gemv:
                codes = cpu_gemv.unpack_int4(self.packed, self.group_size)
            else:
                codes = unpack_cpu_int4(self.packed, self.out_features, self.in_features)
        else:
            # Layout-agnostic: the kernel applied to the identity recovers W^T exactly
            # (each output is one product). Slow, used only off the hot path.
            eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.packed.device)
            unit = self._layout_scales_zeros(torch.ones_like(scale), torch.full_like(zero, 8))
            saved, self.scales_and_zeros = self.scales_and_zeros, unit
            try:
                codes = self._matmul(eye).t().round().to(torch.uint8)  # (q - 8) * 1 + 8 = q
            finally:
                self.scales_and_zeros = saved
        return Int4Weight(codes, scale, zero, self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.gemv and dtype is torch.bfloat16:  # the dense path's: one native pass, same bits
            return cpu_gemv.int4_dequantize(self.packed, self.scales_and_zeros, self.group_size)
        return dequantize_int4(self.int4_weight(), dtype)


class Fp8Linear(QuantizedLinear):
    """fp8 e4m3 weights (per-output-channel scales) times dynamically quantized e4m3
    activations (per-token scales), through ``torch._scaled_mm`` (Ada/Hopper GPUs)."""

    method = "fp8"
    qweight: torch.Tensor  # buffers (registered in __init__)
    scale: torch.Tensor
    scale_row: torch.Tensor

    def __init__(
        self, w: Fp8Weight, bias: torch.Tensor | None, compute_dtype: torch.dtype = torch.bfloat16
    ):
        n, k = w.qweight.shape
        super().__init__(k, n, bias, compute_dtype)
        if n % 16 or k % 16:
            raise ValueError(
                f"fp8 (torch._scaled_mm) needs both dimensions divisible by 16, got [{n}, {k}]"
            )
        self.register_buffer("qweight", w.qweight.contiguous())
        self.register_buffer("scale", w.scale.float().contiguous())
        self.register_buffer("scale_row", self.scale.view(1, n))

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        return x  # quantized per token inside _matmul; the reference below mirrors it

    def kernel_max_rows(self) -> int:
        return UNLIMITED_ROWS  # _scaled_mm serves every row count

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = fp8_quantize_rows(x)
        # Row-wise scaling (per-token x per-channel) folds both scales into the GEMM epilogue.
        # CUDA's row-wise _scaled_mm writes bf16 only: fp16 (or fp32) activations get its bf16
        # output cast back by forward().
        return torch._scaled_mm(
            xq, self.qweight.t(), scale_a=xs, scale_b=self.scale_row, out_dtype=FP8_OUT_DTYPE
        )

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, xs = fp8_quantize_rows(x.reshape(-1, self.in_features))
        y = F.linear(xq.float() * xs, self.dequantize(torch.float32)).to(FP8_OUT_DTYPE).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(Fp8Weight(self.qweight, self.scale), dtype)

    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4


class Int8Embedding(nn.Module):
    """An embedding table in int8 with one scale per row (token): gather, then scale."""

    qweight: torch.Tensor  # buffers (registered in __init__)
    scale: torch.Tensor

    def __init__(self, w: Int8Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = w.qweight.shape
        self.dtype = dtype
        self.register_buffer("qweight", w.qweight.contiguous())
        self.register_buffer("scale", w.scale.float().contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (F.embedding(ids, self.qweight).float() * self.scale[ids].unsqueeze(-1)).to(
            self.dtype
        )

    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"
