"""Small-batch CPU linear kernels (``csrc/gemv.cpp``, ``csrc/gemv_int4.cpp``): load, call.

At decode row counts a linear layer is bound by reading its weight; these kernels stream
the weight once per call, decode each vector of it into registers once and multiply it
with every activation row (fp32 FMAs, or AVX-512 bf16 dot products with float32 sums).
Each output is summed in one fixed order whatever the number of rows, so a row's result
does not depend on the batch it came in (the quantized layers' exactness tests rely on it).

Where the kernels are not built (no AVX-512 bf16, no compiler, ``RADIXSERVE_CPU_KERNELS=0``)
:func:`available` is False and the layers keep their torch/oneDNN paths.
"""

from __future__ import annotations

import functools

import torch

from radixserve.model import native


@functools.cache
def available() -> bool:
    """Whether the kernels are built and supported by this CPU."""
    return native.load() and bool(torch.ops.radixserve_cpu.gemv_supported())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for contiguous ``x`` ``[M, K]`` and ``weight`` ``[N, K]`` of one
    dtype (float32 or bfloat16), summed in float32, rounded once to that dtype."""
    return torch.ops.radixserve_cpu.gemv_dense(x, weight, bias)


INT8_GROUP = 64  # outputs per group of pack_int8's layout


def int8_packable(n: int, k: int) -> bool:
    """Whether an int8 weight ``[n, k]`` fits :func:`pack_int8`'s layout (pairs of inputs)."""
    return k % 2 == 0 and n > 0


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[N, K]`` (K even) -> the int8 kernel's layout ``[ceil(N / 64), K / 2, 64,
    2]``: ``packed[g, p, i, j] = codes[64 g + i, 2 p + j]``, outputs past N zero
    (``csrc/gemv_int8.cpp`` says why)."""
    n, k = codes.shape
    if not int8_packable(n, k):
        raise ValueError(f"pack_int8 needs an even number of inputs, got {k}")
    groups = -(-n // INT8_GROUP)
    padded = codes.new_zeros(groups * INT8_GROUP, k)
    padded[:n] = codes
    return padded.view(groups, INT8_GROUP, k // 2, 2).transpose(1, 2).contiguous()


def unpack_int8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The codes ``[n, K]`` of :func:`pack_int8`'s layout (torch ops, any device)."""
    groups, pairs = packed.shape[:2]
    return packed.transpose(1, 2).reshape(groups * INT8_GROUP, 2 * pairs)[:n].contiguous()


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(x @ codes.T) * scale`` for bfloat16 ``x`` ``[M, K]``, ``packed`` from
    :func:`pack_int8` and bfloat16 ``scale`` ``[N]``: bfloat16 ``[M, N]``."""
    return torch.ops.radixserve_cpu.gemv_int8(x, packed, scale)


def int8_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes.to(bfloat16) * scale[:, None]`` (the same bits) in one native pass from
    :func:`pack_int8`'s layout: bfloat16 ``[N, K]``."""
    return torch.ops.radixserve_cpu.int8_dequantize(packed, scale)


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x @ W.T`` for bfloat16 ``x`` ``[M, K]`` and ``W = (q - 8) * scale + zero`` group-wise,
    ``packed`` from :func:`pack_int4` (with the same ``group_size``), ``scales_zeros`` from
    :func:`int4_scales_zeros`: bfloat16 ``[M, N]``."""
    return torch.ops.radixserve_cpu.gemv_int4(x, packed, scales_zeros, group_size)


def int4_scales_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Scales and zeros ``[N, K / G]`` each -> the kernel's bfloat16 ``[N, 2, K / G]``."""
    return torch.stack([scale, zero], dim=1).to(torch.bfloat16).contiguous()


INT4_TILE = 4  # outputs per tile of the int4 layout (the kernel's tile)


def _row_segments(k: int) -> list[int]:
    """Bytes per output of each segment of a packed row: 64 per 128-input chunk, then 32
    for a last 64 inputs and 16 for a last 32."""
    segs = [64] * (k // 128)
    rest = k % 128
    if rest >= 64:
        segs.append(32)
        rest -= 64
    if rest:
        segs.append(16)
    return segs


@functools.cache
def int4_input_order(k: int, group_size: int) -> torch.Tensor:
    """The kernel's order of the ``k`` inputs (``csrc/gemv_int4.cpp``, "Block order"): position
    ``i`` of the packed stream holds input ``order[i]``. Blocks of ``B`` groups (16 while 16
    are left, then 8, 4, 2, 1); in a block, vector ``j`` (32 inputs) lane ``l`` (2 inputs)
    holds group ``g0 + l // R``'s inputs ``2 (j R + l % R)`` and ``+ 1``, ``R = 16 / B``."""
    if group_size % 32 or k % group_size:
        raise ValueError(
            f"int4 needs a group size multiple of 32 dividing K, got {group_size}, K={k}"
        )
    groups, g0, parts = k // group_size, 0, []
    sizes = [16] * (groups // 16) + [b for b in (8, 4, 2, 1) if groups % 16 & b]
    lane = torch.arange(16)
    for b in sizes:
        r = 16 // b
        j = torch.arange(group_size * b // 32)[:, None]
        first = (g0 + lane // r) * group_size + (j * r + lane % r) * 2  # [vectors, 16]
        parts.append(torch.stack([first, first + 1], dim=-1).reshape(-1))
        g0 += b
    return torch.cat(parts)


def pack_int4(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 codes ``[N, K]`` (0..15; ``N`` a multiple of 4, ``K`` of ``group_size``, itself a
    multiple of 32) -> the kernel's layout, uint8 ``[N, K / 2]``: the inputs in
    :func:`int4_input_order`, then tiles of 4 outputs one after the other; in a tile, segment
    by segment, the 4 outputs' bytes. A 128-input chunk is 32 16-bit lanes, lane ``l``
    holding positions ``l``, ``l + 32``, ``l + 64``, ``l + 96`` from its lowest nibble up
    (little-endian); a last 64, 32 bytes (byte ``j``: ``j`` low, ``j + 32`` high); a last 32,
    16 bytes (``j``, ``j + 16``)."""
    n, k = codes.shape
    if n % INT4_TILE:
        raise ValueError(f"int4 packing needs [N, K] with N % 4 == 0, got {[n, k]}")
    c = codes.to(torch.uint8)[:, int4_input_order(k, group_size)]
    body, rows = k // 128 * 128, []
    if body:
        q = c[:, :body].reshape(n, -1, 4, 32)
        lo, hi = q[:, :, 0] | q[:, :, 1] << 4, q[:, :, 2] | q[:, :, 3] << 4  # bytes 2l, 2l + 1
        rows.append(torch.stack([lo, hi], dim=-1).reshape(n, -1))
    start = body
    if k - start >= 64:
        q = c[:, start : start + 64].reshape(n, 2, 32)
        rows.append(q[:, 0] | q[:, 1] << 4)
        start += 64
    if k > start:
        q = c[:, start:].reshape(n, 2, 16)
        rows.append(q[:, 0] | q[:, 1] << 4)
    row = torch.cat(rows, dim=1)  # [N, K / 2], each output's segments in order
    # Per segment, a tile's 4 outputs' bytes one after the other.
    tiles = [seg.reshape(n // INT4_TILE, -1) for seg in row.split(_row_segments(k), dim=1)]
    return torch.cat(tiles, dim=1).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 codes ``[N, K]`` in input order (the native
    kernel where built: the int4 dense path decodes the weight on every call)."""
    if packed.is_cpu and available():
        return torch.ops.radixserve_cpu.gemv_int4_unpack(packed, group_size)
    return unpack_int4_torch(packed, group_size)


def int4_dequantize(
    packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The weight bfloat16 ``[N, K]`` of :func:`pack_int4`'s layout and :func:`int4_scales_zeros`,
    in input order: ``formats.dequantize_int4``'s bits in one native pass (the int4 dense path
    decodes the weight on every call)."""
    return torch.ops.radixserve_cpu.gemv_int4_dequantize(packed, scales_zeros, group_size)


def unpack_int4_torch(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """:func:`unpack_int4` in torch ops (any device; ~100x slower than the native one)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    tiles = packed.reshape(n // INT4_TILE, -1)
    segs = [s * INT4_TILE for s in _row_segments(k)]
    row = torch.cat(
        [t.reshape(n, -1) for t in tiles.split(segs, dim=1)],
        dim=1,
    )
    parts, off = [], 0
    for seg in _row_segments(k):
        b = row[:, off : off + seg]
        off += seg
        if seg == 64:  # lanes of (byte 2l, byte 2l + 1): inputs l, l + 32 | l + 64, l + 96
            lo, hi = b.reshape(n, 32, 2).unbind(-1)
            parts.append(torch.stack([lo & 0xF, lo >> 4, hi & 0xF, hi >> 4], dim=1).reshape(n, -1))
        else:
            parts.append(torch.cat([b & 0xF, b >> 4], dim=1))
    # Input i sits at position inverse[i] of the stream (a gather: far faster than a scatter).
    inverse = _int4_inverse_order(k, group_size).to(packed.device)
    return torch.cat(parts, dim=1).index_select(1, inverse)


@functools.cache
def _int4_inverse_order(k: int, group_size: int) -> torch.Tensor:
    """``inverse[int4_input_order(k, group_size)] = arange(k)``."""
    return torch.argsort(int4_input_order(k, group_size))
