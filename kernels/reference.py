"""Plain-torch references: the semantics every Triton kernel in ``radixkernels`` must match.

They are also the CPU implementation the torch attention backend builds on, so they are
written to be reasonably fast in torch: per-sequence gathers and one batched matmul per
sequence (extend) or per batch (decode), never a loop over tokens.

Pool layout and quantization formats are defined in :mod:`radixkernels.kv_format`::

    k_data : [num_pages, page_size, kv_heads, packed_head_dim]  (flat: [num_slots, kv_heads, packed_head_dim])
    k_scale: int8/int4 [num_pages, page_size, kv_heads] fp32 | fp8 [kv_heads] fp32 | auto None

Quantization (shared bit-for-bit in intent with the kernels; compare with tolerances):

    int8 : scale = max(absmax, EPS) / 127, q = clamp(floor(x / scale + 0.5), -127, 127)
    int4 : r = x @ H (normalized Hadamard, head_dim a power of two; H @ H = I; computed by the
           fast transform, hadamard_rotate), scale = max(absmax(r), EPS) / 7,
           q = clamp(floor(r / scale + 0.5), -7, 7) + 8 in a nibble,
           element 2i in the low nibble, 2i+1 in the high nibble; dequantize = (q * scale) @ H
    fp8  : q = cast(clamp(x / head_scale, -fmax, fmax))  (static per-head scale, 1.0 by default)

``floor(y + 0.5)`` (round half up) rather than ``torch.round`` (half to even) because it
is what the kernels compute cheaply on every backend; the two differ only on exact ties.

Attention semantics (``paged_attention_ref``): sequence ``b`` has ``seq_lens[b]`` tokens of
KV in the pool (its new rows already stored), its new query rows are
``q[extend_start_loc[b] : extend_start_loc[b] + extend_lens[b]]`` and row ``j`` sits at
position ``seq_lens[b] - extend_lens[b] + j``, attending causally to positions ``0..that``.
Query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)`` (GQA/MQA).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from radixkernels.kv_format import KVCacheDtype, KVFormat

# Floor for absmax so an all-zero row gets a finite, non-zero scale (its codes are all 0).
QUANT_EPS = 1e-8
INT8_QMAX = 127.0
INT4_QMAX = 7.0
INT4_OFFSET = 8
FP8_MAX = {KVCacheDtype.FP8_E4M3: 448.0, KVCacheDtype.FP8_E5M2: 57344.0}


# ----------------------------------------------------------------------------- quantize math

_HADAMARD: dict[tuple[int, str], torch.Tensor] = {}


def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix ``[n, n]`` fp32 (n a power of two).

    ``H[i, j] = (-1) ** popcount(i & j) / sqrt(n)``: symmetric and orthonormal, so it is its
    own inverse. The kernels generate the same entries from the same formula.
    """
    key = (n, str(device))
    if key not in _HADAMARD:
        if n < 1 or n & (n - 1):
            raise ValueError(f"Hadamard size must be a power of two, got {n}")
        i = torch.arange(n)
        v = i[:, None] & i[None, :]
        parity = torch.zeros_like(v)
        while bool(v.any()):
            parity ^= v & 1
            v = v >> 1
        sign = 1.0 - 2.0 * parity.double()
        _HADAMARD[key] = (sign * (1.0 / math.sqrt(n))).float().to(device)
    return _HADAMARD[key]


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ hadamard(D)`` in float32 for ``x`` ``[..., D]`` (D a power of two), by the fast
    transform: stages of butterflies ``(a + b, a - b)`` over elements 1, 2, 4, ... apart, then
    one multiply by the float32 ``1 / sqrt(D)``.

    The same additions in the same order as the CPU kernels' ``hadamard_rotate``
    (``radixserve/model/csrc/hadamard.h``), so their codes agree bit for bit; and each row's bits
    depend on that row alone by construction, which a BLAS matmul does not promise (its
    blocking may follow the number of rows), while the int4 store of a one-row decode step
    must give the codes of the same row stored among a verify step's.
    """
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {d}")
    y = x.float()
    half = 1
    while half < d:
        pairs = y.reshape(*x.shape[:-1], d // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        half *= 2
    return y.reshape(x.shape) * torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)


def token_scales(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """Per-(token, head) symmetric scales of ``x`` ``[T, H, D]``: ``max(absmax, EPS) / qmax`` (fp32 ``[T, H]``)."""
    return x.float().abs().amax(dim=-1).clamp_min(QUANT_EPS) / qmax


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, H, D]`` -> (int8 codes ``[T, H, D]``, fp32 scales ``[T, H]``)."""
    scale = token_scales(x, INT8_QMAX)
    q = torch.floor(x.float() / scale[..., None] + 0.5).clamp_(-INT8_QMAX, INT8_QMAX)
    return q.to(torch.int8), scale


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, H, D]`` (D a power of two) -> (uint8 packed ``[T, H, D // 2]``, fp32 scales ``[T, H]``).

    Quantizes the Hadamard-rotated rows ``x @ H`` (see the module docstring).
    """
    r = hadamard_rotate(x)
    scale = token_scales(r, INT4_QMAX)
    q = (
        torch.floor(r / scale[..., None] + 0.5).clamp_(-INT4_QMAX, INT4_QMAX).to(torch.int32)
        + INT4_OFFSET
    )
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed.to(torch.uint8), scale


def quantize_fp8(x: torch.Tensor, head_scale: torch.Tensor, kv_dtype: KVCacheDtype) -> torch.Tensor:
    """``x`` ``[T, H, D]`` -> fp8 ``[T, H, D]`` of ``x / head_scale[h]``, clamped to the format's range."""
    fmax = FP8_MAX[kv_dtype]
    y = (x.float() / head_scale.float()[None, :, None]).clamp_(-fmax, fmax)
    return y.to(KVFormat.create(kv_dtype, torch.float32, x.shape[-1]).storage_dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., D // 2]`` -> int32 codes in [-8, 7] ``[..., D]`` (even element from the low nibble)."""
    p = packed.to(torch.int32)
    lo = (p & 0xF) - INT4_OFFSET
    hi = (p >> 4) - INT4_OFFSET
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def quantize_ref(
    x: torch.Tensor, fmt: KVFormat, head_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize new rows ``x`` ``[T, H, D]`` into the pool's storage format.

    Returns ``(data [T, H, packed_head_dim], token_scales [T, H] | None)``; fp8 needs the
    layer's static ``head_scale`` ``[H]``.
    """
    kd = fmt.kv_dtype
    if kd is KVCacheDtype.AUTO:
        return x.to(fmt.storage_dtype), None
    if kd is KVCacheDtype.INT8:
        return quantize_int8(x)
    if kd is KVCacheDtype.INT4:
        return quantize_int4(x)
    if head_scale is None:
        raise ValueError(f"{kd.value} KV cache needs a per-head scale tensor")
    return quantize_fp8(x, head_scale, kd), None


def dequantize_ref(data: torch.Tensor, scale: torch.Tensor | None, fmt: KVFormat) -> torch.Tensor:
    """Gathered pool rows ``data`` ``[..., H, packed_head_dim]`` -> float32 ``[..., H, head_dim]``.

    ``scale`` is the matching gathered per-token scales ``[..., H]`` (int8/int4), the
    layer's per-head scales ``[H]`` (fp8), or None (auto).
    """
    kd = fmt.kv_dtype
    if kd is KVCacheDtype.AUTO:
        return data.float()
    assert scale is not None, f"{kd.value} KV cache needs scales"
    # The scale multiplies the float copy in place: the same products as ``x.float() * s``,
    # one float32 tensor fewer to allocate and write (the torch backend dequantizes a long
    # context's history block by block through here on every decode step).
    if kd is KVCacheDtype.INT4:  # un-rotate: H is its own inverse
        return hadamard_rotate(unpack_int4(data).float().mul_(scale.float()[..., None]))
    return data.float().mul_(scale.float()[..., None])


# ----------------------------------------------------------------------------- KV store


def store_kv_ref(
    k_data: torch.Tensor,
    v_data: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    fmt: KVFormat,
) -> None:
    """Write new rows ``k``/``v`` ``[T, Hkv, D]`` of one layer at pool ``slots`` ``[T]``, quantizing.

    int8/int4 also write the per-token scales at the same slots; fp8 reads the static
    per-head scales from ``k_scale``/``v_scale`` ``[Hkv]``.
    """
    H, Dp = k_data.shape[-2], k_data.shape[-1]
    for data, scale, x in ((k_data, k_scale, k), (v_data, v_scale, v)):
        head_scale = scale if fmt.kv_dtype.has_head_scales else None
        q, tok_scale = quantize_ref(x, fmt, head_scale)
        data.view(-1, H, Dp)[slots] = q
        if tok_scale is not None:
            assert scale is not None
            scale.view(-1, H)[slots] = tok_scale


def gather_kv_ref(
    data: torch.Tensor, scale: torch.Tensor | None, fmt: KVFormat, slots: torch.Tensor
) -> torch.Tensor:
    """Dequantized float32 rows ``[*slots.shape, H, head_dim]`` of one layer's K or V at ``slots``."""
    H, Dp = data.shape[-2], data.shape[-1]
    rows = data.view(-1, H, Dp)[slots]
    if fmt.kv_dtype.has_token_scales:
        assert scale is not None
        return dequantize_ref(rows, scale.view(-1, H)[slots], fmt)
    return dequantize_ref(rows, scale, fmt)


def sequence_slots(page_row: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    """Pool slots of positions ``0..seq_len-1`` of one sequence from its page-table row."""
    pos = torch.arange(seq_len, device=page_row.device)
    return page_row[pos // page_size].long() * page_size + pos % page_size


# ----------------------------------------------------------------------------- attention


def _host_list(x: torch.Tensor | Sequence[int] | None, fallback: torch.Tensor) -> list[int]:
    if x is None:
        return [int(n) for n in fallback.tolist()]
    if isinstance(x, torch.Tensor):
        return [int(n) for n in x.tolist()]
    return [int(n) for n in x]


def paged_attention_ref(
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
    seq_lens_cpu: Sequence[int] | None = None,
    extend_lens_cpu: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """General paged attention (extend and decode) reading all K/V from the pool.

    ``q`` ``[T, Hq, D]``; returns ``[T, Hq, D]`` in ``q``'s dtype (written into ``out`` when
    given). ``seq_lens_cpu``/``extend_lens_cpu`` are optional host copies that save a
    device sync. One gather + two batched matmuls per sequence, fp32 math. ``window``: a
    row at position p sees only positions p - window < j <= p; ``softcap``: scores become
    ``softcap * tanh(score / softcap)`` before the mask (Gemma); ``sinks`` ``[Hq]``: each
    head's sink logit joins every row's softmax as a column with no value (gpt-oss).
    """
    T, Hq, D = q.shape
    Hkv = k_data.shape[-2]
    G = Hq // Hkv
    lens = _host_list(seq_lens_cpu, seq_lens)
    exts = _host_list(extend_lens_cpu, extend_lens)
    starts = [int(s) for s in extend_start_loc.tolist()]
    if out is None:
        out = torch.empty_like(q)
    for b, (L, E, s0) in enumerate(zip(lens, exts, starts)):
        if E == 0:
            continue
        slots = sequence_slots(page_table[b], L, page_size)
        k = gather_kv_ref(k_data, k_scale, fmt, slots)  # [L, Hkv, D]
        v = gather_kv_ref(v_data, v_scale, fmt, slots)
        # [E, Hq, D] -> [Hkv, G*E, D], rows ordered (g, e).
        qh = q[s0 : s0 + E].float().view(E, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * E, D)
        scores = _cap(torch.bmm(qh, k.permute(1, 2, 0)) * sm_scale, softcap)  # [Hkv, G*E, L]
        q_pos = (L - E) + torch.arange(E, device=q.device)
        dist = q_pos[:, None] - torch.arange(L, device=q.device)[None, :]  # [E, L]
        causal = (dist < 0) if window is None else (dist < 0) | (dist >= window)
        scores = scores.view(Hkv, G, E, L).masked_fill_(causal, float("-inf")).view(Hkv, G * E, L)
        row_sinks = None if sinks is None else sinks.view(Hkv, G, 1, 1).expand(-1, -1, E, 1)
        probs = _softmax(scores, None if row_sinks is None else row_sinks.reshape(Hkv, G * E, 1))
        o = torch.bmm(probs, v.permute(1, 0, 2))  # [Hkv, G*E, D]
        out[s0 : s0 + E] = o.view(Hkv, G, E, D).permute(2, 0, 1, 3).reshape(E, Hq, D).to(out.dtype)
    return out


def paged_decode_attention_ref(
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
    """Decode attention: one query row per sequence, ``q`` ``[B, Hq, D]`` over its whole history
    (its last ``window`` positions with a window; ``softcap`` and ``sinks`` as in
    :func:`paged_attention_ref`).

    Batched over sequences by padding to ``max_seq_len`` (computed when not given) with a
    length mask; ``num_kv_splits`` is accepted for signature parity with the kernel and
    ignored. Page-table entries past a sequence's pages are never dereferenced.
    """
    B, Hq, D = q.shape
    Hkv = k_data.shape[-2]
    G = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    Lmax = int(seq_lens.max().item()) if max_seq_len is None else int(max_seq_len)
    pos = torch.arange(Lmax, device=q.device)
    lens = seq_lens.to(q.device).long()[:, None]
    valid = pos[None, :] < lens  # [B, Lmax]
    page_idx = (pos // page_size).clamp_max(page_table.shape[1] - 1)
    slots = page_table[:, page_idx].long() * page_size + pos % page_size
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    k = gather_kv_ref(k_data, k_scale, fmt, slots)  # [B, Lmax, Hkv, D]
    # Padding rows read slot 0, which may hold anything (NaN included): zero them, since
    # a masked probability of 0 times NaN would still poison the output.
    v = gather_kv_ref(v_data, v_scale, fmt, slots).masked_fill_(~valid[:, :, None, None], 0.0)
    qh = q.float().view(B, Hkv, G, D)
    scores = _cap(torch.einsum("bhgd,blhd->bhgl", qh, k) * sm_scale, softcap)
    seen = valid if window is None else valid & (pos[None, :] >= lens - window)
    scores.masked_fill_(~seen[:, None, None, :], float("-inf"))
    row_sinks = None if sinks is None else sinks.view(1, Hkv, G, 1).expand(B, -1, -1, 1)
    o = torch.einsum("bhgl,blhd->bhgd", _softmax(scores, row_sinks), v)
    out.copy_(o.reshape(B, Hq, D))
    return out


def extend_attention_ref(
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
    """Prefix-extend attention: the signature of :func:`radixkernels.extend_attention`.

    Same semantics as :func:`paged_attention_ref` (``max_extend_len`` is a kernel launch
    hint, ignored here).
    """
    return paged_attention_ref(
        q,
        k_data,
        v_data,
        k_scale,
        v_scale,
        fmt,
        page_table,
        seq_lens,
        extend_lens,
        extend_start_loc,
        page_size,
        sm_scale,
        out=out,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; with ``sinks`` (one per row, shaped ``scores[..., :1]``) a
    column that joins the denominator and is dropped after (transformers' gpt-oss)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    joined = torch.cat([scores, sinks.to(scores.device, torch.float32)], dim=-1)
    return torch.softmax(joined, dim=-1)[..., :-1]


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap
