"""How one token's K (or V) is stored in the paged KV pool, per KV-cache dtype.

This module is the single source of truth shared by the pool (allocation), the memory
planner (byte accounting) and the kernels (store / dequantize). Layout, per layer::

    k_data[layer] : [num_pages, page_size, kv_heads, packed_head_dim]   storage dtype
    v_data[layer] : same
    k_scale[layer]: scale_shape (see below), float32, or None
    v_scale[layer]: same

    slot = page_id * page_size + offset_in_page   (flat view: [num_slots, kv_heads, packed_head_dim])

Per dtype:

    dtype      storage          packed_head_dim   scales
    auto       activation dtype head_dim          none
    fp8_e4m3   float8_e4m3fn    head_dim          per (layer, kv_head): [kv_heads], static (1.0 unless calibrated)
    fp8_e5m2   float8_e5m2      head_dim          per (layer, kv_head): [kv_heads], static
    int8       int8             head_dim          per (token, kv_head): [num_pages, page_size, kv_heads]
    int4       uint8 (2/byte)   head_dim // 2     per (token, kv_head): [num_pages, page_size, kv_heads]

int8/int4 are symmetric: q = round(x / scale), scale = absmax / 127 (int8) or absmax / 7 (int4);
int4 stores q + 8 in a nibble, element 2i in the low nibble and 2i+1 in the high nibble.
int4 first rotates each (token, head) row by the normalized Hadamard matrix H (D x D, a power
of two; H is symmetric and orthonormal, so dequantization multiplies by H again): the
rotation spreads the few outlier channels of K (RoPE dims) over all channels, so one
absmax scale per row no longer crushes the small ones. On SmolLM2 it cuts int4's mean KL
against the unquantized cache about 3x (benchmarks/bench_kv_quant_accuracy.py). Attention
kernels rotate q the same way and un-rotate the output, so they never materialize K or V.
fp8 uses a static per-head scale because fp8 keeps relative precision across its range;
the scale only has to keep values inside the format's range (448 for e4m3, 57344 for e5m2).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class KVCacheDtype(enum.StrEnum):
    """The values accepted by ``--kv-cache-dtype``."""

    AUTO = "auto"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def is_quantized(self) -> bool:
        return self is not KVCacheDtype.AUTO

    @property
    def has_token_scales(self) -> bool:
        """Per-token-per-head scales live beside every page (int8, int4)."""
        return self in (KVCacheDtype.INT8, KVCacheDtype.INT4)

    @property
    def has_head_scales(self) -> bool:
        """One static scale per (layer, kv_head) (fp8)."""
        return self in (KVCacheDtype.FP8_E4M3, KVCacheDtype.FP8_E5M2)


SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVFormat:
    """Storage format of K or V in the pool for one KV-cache dtype and activation dtype."""

    kv_dtype: KVCacheDtype
    act_dtype: torch.dtype
    head_dim: int

    @staticmethod
    def create(kv_dtype: KVCacheDtype | str, act_dtype: torch.dtype, head_dim: int) -> KVFormat:
        kd = KVCacheDtype(kv_dtype)
        if kd is KVCacheDtype.INT4 and (head_dim < 2 or head_dim & (head_dim - 1)):
            raise ValueError(
                f"int4 KV cache needs a power-of-two head_dim (Hadamard rotation), got {head_dim}"
            )
        return KVFormat(kd, act_dtype, head_dim)

    @property
    def storage_dtype(self) -> torch.dtype:
        return {
            KVCacheDtype.AUTO: self.act_dtype,
            KVCacheDtype.FP8_E4M3: torch.float8_e4m3fn,
            KVCacheDtype.FP8_E5M2: torch.float8_e5m2,
            KVCacheDtype.INT8: torch.int8,
            KVCacheDtype.INT4: torch.uint8,
        }[self.kv_dtype]

    @property
    def packed_head_dim(self) -> int:
        return self.head_dim // 2 if self.kv_dtype is KVCacheDtype.INT4 else self.head_dim

    def data_bytes_per_token_head(self) -> int:
        """Bytes of K (or V) data for one token and one KV head."""
        return self.packed_head_dim * torch.empty((), dtype=self.storage_dtype).element_size()

    def scale_bytes_per_token_head(self) -> int:
        """Bytes of per-token scales for one token and one KV head (0 when scales are per head)."""
        return SCALE_DTYPE.itemsize if self.kv_dtype.has_token_scales else 0

    def bytes_per_token(self, num_layers: int, kv_heads: int) -> int:
        """Bytes one token occupies in the pool: K and V, every layer, scales included."""
        per_head = self.data_bytes_per_token_head() + self.scale_bytes_per_token_head()
        return 2 * num_layers * kv_heads * per_head
