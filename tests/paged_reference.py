"""The reference answer of one attention call over a paged pool, for backend tests."""

from __future__ import annotations

import torch

from radixkernels.reference import paged_attention_ref, store_kv_ref
from radixserve.memory.pool import KVPool
from radixserve.model.forward_batch import ForwardBatch


def layer0(scales: list[torch.Tensor] | None) -> torch.Tensor | None:
    """Layer 0's scales of a pool's per-layer scale list (None for unquantized pools)."""
    return None if scales is None else scales[0]


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fb: ForwardBatch,
    ref_pool: KVPool,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """Store the step's K/V into layer 0 of ``ref_pool`` with the reference store, then return
    the reference attention of ``q`` over the batch's pages."""
    k_scale, v_scale = layer0(ref_pool.k_scale), layer0(ref_pool.v_scale)
    store_kv_ref(
        ref_pool.k_data[0],
        ref_pool.v_data[0],
        k_scale,
        v_scale,
        k,
        v,
        fb.out_cache_loc,
        ref_pool.fmt,
    )
    return paged_attention_ref(
        q,
        ref_pool.k_data[0],
        ref_pool.v_data[0],
        k_scale,
        v_scale,
        ref_pool.fmt,
        fb.page_table,
        fb.seq_lens,
        fb.extend_lens,
        fb.extend_start_loc,
        page_size,
        scale,
    )


def last_rows_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 attention of rows ``q`` [rows, Hq, D] at the last positions of ``k``/``v``
    [n, Hkv, D]: causal, within the last ``window`` positions, scores soft-capped, and each
    head's ``sinks`` logit in its rows' denominators (the CPU kernel's tests' reference)."""
    rows, hq, _ = q.shape
    n, hkv, _ = k.shape
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("rhd,nhd->rhn", q.double(), kk) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    dist = torch.arange(n - rows, n)[:, None] - torch.arange(n)[None, :]
    hidden = (dist < 0) | (dist >= (window or n))
    s = s.masked_fill(hidden[:, None, :], float("-inf"))
    top = s.amax(-1, keepdim=True)  # every row sees its own key: finite
    weights = torch.exp(s - top)
    total = weights.sum(-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sinks.double()[None, :, None] - top)
    return torch.einsum("rhn,nhd->rhd", weights / total, vv)
