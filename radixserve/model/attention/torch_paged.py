"""Paged attention in plain torch: the path that runs on CPU and the baseline for the kernels.

Each layer call (1) stores the step's new K/V rows into the pool at ``batch.out_cache_loc``
and (2) attends over every sequence's whole history read back from the pool::

    pool (flat view)  [num_pages * page_size, kv_heads, head_dim]
    slot of position j of sequence b = page_table[b, j // page_size] * page_size + j % page_size

    decode sequences (1 new row):  one batched SDPA over a [B, L_max] gather, padding masked;
                                   the query heads of one KV head ride in SDPA's query-length
                                   axis, so GQA/MQA need no K/V expansion
    extend sequences (n new rows): one SDPA per sequence, rows at positions prefix..prefix+n-1
                                   see positions 0..their own (causal with an offset)

Everything that depends only on the batch (slot indices, masks) is computed once per
forward, at layer 0, and reused by every layer. Quantized pools go through the reference
store / dequantize of ``radixkernels.reference``; the unquantized case is a plain
``index_copy_`` / ``index_select``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.model.attention.base import AttentionBackend
from radixserve.model.forward_batch import ForwardBatch


@dataclass
class _ExtendSeq:
    rows: slice  # rows of this sequence in the batch
    slots: torch.Tensor  # [L] int64 pool slots of positions 0..L-1
    mask: torch.Tensor | None  # [n, L] bool (None: plain causal, nothing cached before)


@dataclass
class _BatchMeta:
    decode_rows: torch.Tensor | None  # [Bd] int64 rows of the decode sequences
    decode_slots: torch.Tensor | None  # [Bd * L_max] int64
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, L_max] bool
    decode_shape: tuple[int, int]  # (Bd, L_max)
    extends: list[_ExtendSeq]


class TorchPagedAttentionBackend(AttentionBackend):
    """Stores new K/V into a ``KVPool`` and attends over the paged history, in torch."""

    def __init__(self, pool: object) -> None:
        self.pool = pool
        self.fmt = pool.fmt  # type: ignore[attr-defined]
        self._quantized = self.fmt.kv_dtype.is_quantized
        self._meta_batch: ForwardBatch | None = None
        self._meta: _BatchMeta | None = None

    # -- per-forward metadata ------------------------------------------------------------

    def _prepare(self, batch: ForwardBatch) -> _BatchMeta:
        if self._meta_batch is batch and self._meta is not None:
            return self._meta
        assert batch.page_table is not None and batch.out_cache_loc is not None, "paged backend needs a paged batch"
        ps = batch.page_size
        dev = batch.page_table.device
        table = batch.page_table.to(torch.int64)
        ext_lens = batch.extend_lens_cpu
        seq_lens = batch.seq_lens_cpu
        decode_idx = [b for b, n in enumerate(ext_lens) if n == 1]
        starts = _starts(ext_lens)

        decode_rows = decode_slots = decode_mask = None
        shape = (0, 0)
        if decode_idx:
            d = torch.tensor(decode_idx, dtype=torch.int64, device=dev)
            lens = torch.tensor([seq_lens[b] for b in decode_idx], dtype=torch.int64, device=dev)
            l_max = max(seq_lens[b] for b in decode_idx)
            j = torch.arange(l_max, dtype=torch.int64, device=dev)
            pages = table.index_select(0, d)[:, j // ps]  # [Bd, L_max]
            valid = j[None, :] < lens[:, None]
            decode_slots = torch.where(valid, pages * ps + (j % ps)[None, :], 0).reshape(-1)
            decode_mask = valid[:, None, None, :]
            decode_rows = torch.tensor([starts[b] for b in decode_idx], dtype=torch.int64, device=dev)
            shape = (len(decode_idx), l_max)

        extends: list[_ExtendSeq] = []
        for b, n in enumerate(ext_lens):
            if n == 1:
                continue
            length = seq_lens[b]
            prefix = length - n
            j = torch.arange(length, dtype=torch.int64, device=dev)
            slots = table[b, j // ps] * ps + j % ps
            mask = None
            if prefix > 0:
                i = torch.arange(n, dtype=torch.int64, device=dev)
                mask = j[None, :] <= (prefix + i)[:, None]
            extends.append(_ExtendSeq(slice(starts[b], starts[b] + n), slots, mask))

        self._meta = _BatchMeta(decode_rows, decode_slots, decode_mask, shape, extends)
        self._meta_batch = batch
        return self._meta

    # -- pool access ---------------------------------------------------------------------

    def _store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        pool = self.pool
        if self._quantized:
            from radixkernels.reference import store_kv_ref

            store_kv_ref(
                pool.k_data[layer_id], pool.v_data[layer_id],  # type: ignore[attr-defined]
                _scale(pool, "k_scale", layer_id), _scale(pool, "v_scale", layer_id),
                k, v, slots, self.fmt,
            )
            return
        kd, vd = pool.k_data[layer_id], pool.v_data[layer_id]  # type: ignore[attr-defined]
        kd.view(-1, kd.shape[-2], kd.shape[-1]).index_copy_(0, slots, k.to(kd.dtype))
        vd.view(-1, vd.shape[-2], vd.shape[-1]).index_copy_(0, slots, v.to(vd.dtype))

    def _gather(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows at ``slots``, ``[len(slots), kv_heads, head_dim]`` in ``dtype``."""
        pool = self.pool
        kd, vd = pool.k_data[layer_id], pool.v_data[layer_id]  # type: ignore[attr-defined]
        kf = kd.view(-1, kd.shape[-2], kd.shape[-1])
        vf = vd.view(-1, vd.shape[-2], vd.shape[-1])
        if not self._quantized:
            return kf.index_select(0, slots).to(dtype), vf.index_select(0, slots).to(dtype)
        from radixkernels.reference import dequantize_ref

        ks, vs = _scale(pool, "k_scale", layer_id), _scale(pool, "v_scale", layer_id)
        if self.fmt.kv_dtype.has_token_scales:
            ks = ks.view(-1, ks.shape[-1]).index_select(0, slots)
            vs = vs.view(-1, vs.shape[-1]).index_select(0, slots)
        k = dequantize_ref(kf.index_select(0, slots), ks, self.fmt).to(dtype)
        v = dequantize_ref(vf.index_select(0, slots), vs, self.fmt).to(dtype)
        return k, v

    # -- attention -----------------------------------------------------------------------

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        sm_scale: float,
    ) -> torch.Tensor:
        meta = self._prepare(batch)
        self._store(layer_id, k, v, batch.out_cache_loc)  # type: ignore[arg-type]
        num_tokens, hq, d = q.shape
        hkv = k.shape[1]
        group = hq // hkv
        out = torch.empty_like(q)

        if meta.decode_rows is not None:
            bd, l_max = meta.decode_shape
            kk, vv = self._gather(layer_id, meta.decode_slots, q.dtype)  # type: ignore[arg-type]
            kk = kk.view(bd, l_max, hkv, d).transpose(1, 2)  # [Bd, Hkv, L, D]
            vv = vv.view(bd, l_max, hkv, d).transpose(1, 2)
            qq = q.index_select(0, meta.decode_rows).view(bd, hkv, group, d)  # heads of a KV head as "rows"
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=meta.decode_mask, scale=sm_scale)
            out.index_copy_(0, meta.decode_rows, o.reshape(bd, hq, d))

        for seq in meta.extends:
            kk, vv = self._gather(layer_id, seq.slots, q.dtype)
            qq = q[seq.rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            kk = kk.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vv = vv.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=seq.mask, is_causal=seq.mask is None, scale=sm_scale, enable_gqa=group > 1
            )
            out[seq.rows] = o.squeeze(0).transpose(0, 1)
        return out


def _starts(lens: list[int]) -> list[int]:
    starts, acc = [], 0
    for n in lens:
        starts.append(acc)
        acc += n
    return starts


def _scale(pool: object, name: str, layer_id: int) -> torch.Tensor | None:
    scales = getattr(pool, name, None)
    return None if scales is None else scales[layer_id]
