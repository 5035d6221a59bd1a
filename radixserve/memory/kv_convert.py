"""Page copies between pools of different KV formats: an L2 in a smaller dtype than L1.

The L2 host tier may store pages in a smaller KV dtype than L1 (``--hicache-dtype``), so
that more prefixes fit in the same host memory. A page then moves by converting its rows:
dequantize from the source format to float32, quantize to the destination format, with the
project's KV-quantization reference functions (``radixkernels.reference``, the same rounding
the quantized L1 pools use). Demotion rounds once (L1 -> L2); a load-back only widens
(L2 -> L1 is exact when L1 is wider). The conversion runs on the device when one side is
CUDA (a quantized page crosses PCIe at its smaller size).

    hicache dtype   L2 storage                    bytes / element (vs fp32 L1)
    auto            L1's format                   as L1
    bfloat16        bf16                          2 (1/2)
    fp8_e4m3        float8_e4m3fn, per-head 1.0   1 (1/4)
    int8            int8 + fp32 per-token scales  1 + 4/head_dim
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkernels.kv_format import KVCacheDtype
from radixkernels.reference import dequantize_ref, quantize_ref
from radixserve.memory.pool import KVPool

HICACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "fp8_e4m3", "int8")


def host_format(device_pool: KVPool, hicache_dtype: str) -> tuple[KVCacheDtype, torch.dtype]:
    """The (kv_dtype, act_dtype) of an L2 pool behind ``device_pool`` for ``hicache_dtype``."""
    fmt = device_pool.fmt
    if hicache_dtype == "auto":
        return fmt.kv_dtype, fmt.act_dtype
    if hicache_dtype == "bfloat16":
        return KVCacheDtype.AUTO, torch.bfloat16
    if hicache_dtype in ("fp8_e4m3", "int8"):
        return KVCacheDtype(hicache_dtype), fmt.act_dtype
    raise ValueError(f"unknown hicache dtype {hicache_dtype!r}; expected one of {HICACHE_DTYPES}")


def same_geometry(a: KVPool, b: KVPool) -> bool:
    """Whether pages of ``a`` and ``b`` hold the same tokens, layers and heads (formats aside)."""
    return (a.num_layers, a.page_size, a.kv_heads, a.head_dim) == (
        b.num_layers,
        b.page_size,
        b.kv_heads,
        b.head_dim,
    )


def convert_pages(
    src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]
) -> None:
    """Write ``src`` pages ``src_pages[i]`` into ``dst`` pages ``dst_pages[i]`` in ``dst``'s
    format: one gather, conversion and scatter for K and for V over all layers at once (per
    layer when either side is fp8, whose scales are per layer)."""
    work = src.device if src.device.type == "cuda" else dst.device
    si = torch.tensor(list(src_pages), dtype=torch.long, device=src.device)
    di = torch.tensor(list(dst_pages), dtype=torch.long, device=dst.device)
    if src.fmt.kv_dtype.has_head_scales or dst.fmt.kv_dtype.has_head_scales:
        for layer in range(src.num_layers):
            for kv in (0, 1):
                _convert(src, si, dst, di, work, kv, layer)
    else:
        for kv in (0, 1):
            _convert(src, si, dst, di, work, kv, None)


def _convert(
    src: KVPool,
    si: torch.Tensor,
    dst: KVPool,
    di: torch.Tensor,
    work: torch.device,
    kv: int,
    layer: int | None,
) -> None:
    """Convert K (``kv`` 0) or V (1) of the indexed pages, of one ``layer`` or of all (None)."""
    sf, df = src.fmt, dst.fmt
    s_data, d_data = src.page_tensors()[kv], dst.page_tensors()[kv]  # [L, pages, ps, H, packed]
    dim = 1 if layer is None else 0
    if layer is not None:
        s_data, d_data = s_data[layer], d_data[layer]
    rows = s_data.index_select(dim, si).to(work)
    scale = None
    if sf.kv_dtype.has_token_scales:
        s_scale = src.page_tensors()[2 + kv]
        scale = (s_scale if layer is None else s_scale[layer]).index_select(dim, si).to(work)
    elif sf.kv_dtype.has_head_scales:
        assert layer is not None
        scale = (src.k_scale if kv == 0 else src.v_scale)[layer].to(work)  # type: ignore[index]
    x = dequantize_ref(rows, scale, sf)
    head = None
    if df.kv_dtype.has_head_scales:
        assert layer is not None
        head = (dst.k_scale if kv == 0 else dst.v_scale)[layer].to(work)  # type: ignore[index]
    q, tok = quantize_ref(x.reshape(-1, src.kv_heads, src.head_dim), df, head)
    q = q.reshape(*rows.shape[:-1], -1).to(dst.device)
    if q.dtype.is_floating_point and q.element_size() == 1:  # fp8: no index_copy_ on CPU
        q, d_data = q.view(torch.uint8), d_data.view(torch.uint8)
    d_data.index_copy_(dim, di, q)
    if tok is not None:
        d_scale = dst.page_tensors()[2 + kv]
        d_scale = d_scale if layer is None else d_scale[layer]
        d_scale.index_copy_(dim, di, tok.reshape(rows.shape[:-1]).to(dst.device))
