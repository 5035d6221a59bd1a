"""Paged attention in plain torch: the path that runs on CPU and the baseline for the kernels.

Each layer call (1) stores the step's new K/V rows into the pool at ``batch.out_cache_loc``
and (2) attends over every sequence's whole history read back from the pool::

    pool (one layer)  [num_pages, page_size, kv_heads, head_dim]; flat slot = page * page_size + offset
    position j of sequence b lives in page page_table[b, j // page_size] at offset j % page_size

    decode sequences (1 new row):  one batched SDPA over a [B, pages * page_size] gather of
                                   whole pages, positions past each sequence's end masked;
                                   the query heads of one KV head ride in SDPA's query-length
                                   axis, so GQA/MQA need no K/V expansion
    extend sequences (n new rows): one SDPA per sequence, rows at positions prefix..prefix+n-1
                                   see positions 0..their own (causal with an offset)

Everything that depends only on the batch (slot indices, masks) is computed once per
forward, at layer 0, and reused by every layer. Quantized pools go through the reference
store / dequantize of ``radixkernels.reference``; the unquantized case is a plain
``index_copy_`` of rows and an ``index_select`` of whole pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.model.attention.base import AttentionBackend
from radixserve.model.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from radixserve.memory.pool import KVPool


@dataclass
class _ExtendSeq:
    rows: slice  # rows of this sequence in the batch
    pages: torch.Tensor  # [ceil(L / page_size)] int64 pages holding positions 0..L-1
    length: int  # L
    mask: torch.Tensor | None  # [n, L] bool (None: plain causal, nothing cached before)


@dataclass
class _BatchMeta:
    decode_rows: torch.Tensor | None  # [Bd] int64 rows of the decode sequences
    decode_pages: torch.Tensor | None  # [Bd * P] int64 pages, padded with page 0
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, P * page_size] additive: 0 attended, -inf padding
    decode_shape: tuple[int, int]  # (Bd, P)
    extends: list[_ExtendSeq]


class TorchPagedAttentionBackend(AttentionBackend):
    """Stores new K/V into a ``KVPool`` and attends over the paged history, in torch.

    K/V are gathered a whole page at a time (``page_size`` tokens of one layer are one
    contiguous block), which moves far fewer, larger pieces than a gather per token.
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.fmt = pool.fmt
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

        decode_rows = decode_pages = decode_mask = None
        shape = (0, 0)
        if decode_idx:
            d = torch.tensor(decode_idx, dtype=torch.int64, device=dev)
            lens = torch.tensor([seq_lens[b] for b in decode_idx], dtype=torch.int64, device=dev)
            n_pages = -(-max(seq_lens[b] for b in decode_idx) // ps)
            p = torch.arange(n_pages, dtype=torch.int64, device=dev)
            used = p[None, :] * ps < lens[:, None]  # pages past a sequence's end are padding
            decode_pages = torch.where(used, table.index_select(0, d)[:, :n_pages], 0).reshape(-1)
            j = torch.arange(n_pages * ps, dtype=torch.int64, device=dev)
            # An additive float mask: CPU SDPA converts a bool mask on every call (every layer),
            # which made decode attention ~2x slower.
            padding = j[None, :] >= lens[:, None]
            decode_mask = torch.zeros(padding.shape, dtype=self.fmt.act_dtype, device=dev)
            decode_mask = decode_mask.masked_fill_(padding, float("-inf"))[:, None, None, :]
            decode_rows = torch.tensor([starts[b] for b in decode_idx], dtype=torch.int64, device=dev)
            shape = (len(decode_idx), n_pages)

        extends: list[_ExtendSeq] = []
        for b, n in enumerate(ext_lens):
            if n == 1:
                continue
            length = seq_lens[b]
            prefix = length - n
            mask = None
            if prefix > 0:
                i = torch.arange(n, dtype=torch.int64, device=dev)
                j = torch.arange(length, dtype=torch.int64, device=dev)
                mask = j[None, :] <= (prefix + i)[:, None]
            pages = table[b, : -(-length // ps)]
            extends.append(_ExtendSeq(slice(starts[b], starts[b] + n), pages, length, mask))

        self._meta = _BatchMeta(decode_rows, decode_pages, decode_mask, shape, extends)
        self._meta_batch = batch
        return self._meta

    # -- pool access ---------------------------------------------------------------------

    def _store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        pool = self.pool
        if self._quantized:
            from radixkernels.reference import store_kv_ref

            store_kv_ref(
                pool.k_data[layer_id], pool.v_data[layer_id],
                _scale(pool, "k_scale", layer_id), _scale(pool, "v_scale", layer_id),
                k, v, slots, self.fmt,
            )
            return
        kd, vd = pool.k_data[layer_id], pool.v_data[layer_id]
        kd.view(-1, kd.shape[-2], kd.shape[-1]).index_copy_(0, slots, k.to(kd.dtype))
        vd.view(-1, vd.shape[-2], vd.shape[-1]).index_copy_(0, slots, v.to(vd.dtype))

    def _gather(self, layer_id: int, pages: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole ``pages``: ``[len(pages) * page_size, kv_heads, head_dim]`` in ``dtype``."""
        pool = self.pool
        kd, vd = pool.k_data[layer_id], pool.v_data[layer_id]
        h, dp = kd.shape[-2], kd.shape[-1]
        k = kd.index_select(0, pages).view(-1, h, dp)
        v = vd.index_select(0, pages).view(-1, h, dp)
        if not self._quantized:
            return k.to(dtype), v.to(dtype)
        from radixkernels.reference import dequantize_ref

        ks, vs = _scale(pool, "k_scale", layer_id), _scale(pool, "v_scale", layer_id)
        if self.fmt.kv_dtype.has_token_scales:
            assert ks is not None and vs is not None
            ks = ks.index_select(0, pages).view(-1, h)
            vs = vs.index_select(0, pages).view(-1, h)
        return dequantize_ref(k, ks, self.fmt).to(dtype), dequantize_ref(v, vs, self.fmt).to(dtype)

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
            bd, n_pages = meta.decode_shape
            kk, vv = self._gather(layer_id, meta.decode_pages, q.dtype)  # type: ignore[arg-type]
            kk = kk.view(bd, -1, hkv, d).transpose(1, 2)  # [Bd, Hkv, P * page_size, D]
            vv = vv.view(bd, -1, hkv, d).transpose(1, 2)
            qq = q.index_select(0, meta.decode_rows).view(bd, hkv, group, d)  # heads of a KV head as "rows"
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=meta.decode_mask, scale=sm_scale)
            out.index_copy_(0, meta.decode_rows, o.reshape(bd, hq, d))

        for seq in meta.extends:
            kk, vv = self._gather(layer_id, seq.pages, q.dtype)
            qq = q[seq.rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            kk = kk[: seq.length].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vv = vv[: seq.length].transpose(0, 1).unsqueeze(0)
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


def _scale(pool: KVPool, name: str, layer_id: int) -> torch.Tensor | None:
    scales = getattr(pool, name, None)
    return None if scales is None else scales[layer_id]
