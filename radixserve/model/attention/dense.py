"""Dense attention over whole sequences (nothing cached): the reference backend.

Each sequence of the ragged batch attends causally to its own rows only. Sequences are
handled by one ``scaled_dot_product_attention`` call each (a loop over sequences, never over
tokens); GQA/MQA is expanded by the kernel itself (``enable_gqa``), which works for any
integer group size, e.g. SmolLM2's 9 query heads over 3 KV heads. A block-diagonal mask over
all ``T`` rows would be one call but costs ``T^2`` memory; per-sequence calls cost only
``sum(L_i^2)``. When every sequence has the same length the batch is one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.model.attention.base import AttentionBackend
from radixserve.model.attention.windowed import masked_attention
from radixserve.model.forward_batch import ForwardBatch


class DenseAttentionBackend(AttentionBackend):
    """Causal attention within each sequence of a batch of full sequences (no KV pool).

    Only valid when nothing is cached (``prefix_lens == 0``, ``extend_lens == seq_lens``):
    a decode step needs the history, which only a paged backend has.
    """

    supports_sinks = True

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        sm_scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if batch.extend_lens_cpu != batch.seq_lens_cpu:
            raise ValueError("DenseAttentionBackend only runs full sequences (no cached prefix)")
        if window is not None or softcap is not None or sinks is not None:
            return self._masked(q, k, v, batch, sm_scale, window, softcap, sinks)
        gqa = q.shape[1] != k.shape[1]
        lens = batch.extend_lens_cpu
        if len(lens) > 1 and min(lens) == max(lens):
            # Equal lengths: one batched call, [B, H, L, D], no loop at all.
            b, n = len(lens), lens[0]
            qb, kb, vb = (x.view(b, n, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(
                qb,
                kb,
                vb,
                is_causal=True,
                scale=sm_scale,
                enable_gqa=gqa,
            )
            return o.transpose(1, 2).reshape(q.shape)
        out = torch.empty_like(q)
        start = 0
        for n in batch.extend_lens_cpu:
            end = start + n
            # [L, H, D] -> [H, L, D]: heads are SDPA's batch dimension.
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1),
                is_causal=True,
                scale=sm_scale,
                enable_gqa=gqa,
            )
            out[start:end] = o.transpose(0, 1)
            start = end
        return out

    @staticmethod
    def _masked(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        sm_scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Per sequence, with a sliding window, a soft-cap and/or sinks (``windowed.py``)."""
        out = torch.empty_like(q)
        start = 0
        for n in batch.extend_lens_cpu:
            pos = torch.arange(n, device=q.device)
            sl = slice(start, start + n)
            out[sl] = masked_attention(
                q[sl], k[sl], v[sl], pos, pos, sm_scale, window, softcap, sinks
            )
            start += n
        return out
