"""Paged attention on the radixkernels Triton kernels (GPU; on the CPU through the interpreter).

Each layer call stores the step's new K/V rows into the pool (quantizing when the KV dtype
is quantized) and then sends each row to the kernel made for it, as SGLang splits a mixed
batch. Sequences with one new row (decodes, and prompts whose all but last token were
cached) are decode rows; the scheduler lays them out first (SGLang: last), so a batch is::

    sequences:  | decode run (1 row each) | extend sequences (chunks) | decode run |
    kernel:       paged_decode_attention     extend_attention            paged_decode_attention
                  (flash-decoding, split     (token-major tiles over     (same as the first run)
                  count bucketed)            the head group)

Every segment is a view (rows of q/out, rows of the page table and lengths): no copies. Both
kernels read each KV head once for its whole group of query heads (GQA), any group size.
A run of 1-row sequences in the middle of the extend segment stays there (correct either way).

A layer's sliding window and attention soft-cap (Gemma, Mistral) go to both kernels, which
read only the blocks some row's window reaches. Both read every position, the new ones
included, back from the pool, so the quantized
cache changes the attention exactly as it will for later steps. Same semantics as
:class:`~radixserve.model.attention.torch_paged.TorchPagedAttentionBackend`.

On a CPU device the kernels can only run under the Triton interpreter, and Triton reads
``TRITON_INTERPRET`` when it is imported (its own library functions are defined then) and
when each kernel is defined. The backend turns the interpreter on when triton is not
imported yet; when it already is (transformers or torch may import it while the model
loads), the process must have been started with ``TRITON_INTERPRET=1``::

    TRITON_INTERPRET=1 radixserve generate --attention-backend triton ...   # CPU, slow
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

import torch

from radixserve.model.attention.base import AttentionBackend
from radixserve.model.forward_batch import ForwardBatch


def _triton_interpreted() -> bool | None:
    """None if triton is not imported yet, else whether it was imported for the interpreter."""
    if "triton" not in sys.modules:
        return None
    import triton.language as tl

    return type(tl.max).__name__ == "InterpretedFunction"


def _ensure_runnable(device: torch.device) -> None:
    """Make sure the kernels will run on ``device`` (interpreter on CPU, compiler on CUDA)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type == "cpu":
        imported = _triton_interpreted()
        if imported is None:
            os.environ["TRITON_INTERPRET"] = "1"
        elif not (imported and interpreting):
            raise RuntimeError(
                "attention_backend 'triton' on the CPU runs the kernels in Triton's interpreter, which must be "
                "on before triton is imported: start the process with TRITON_INTERPRET=1 "
                "(e.g. TRITON_INTERPRET=1 radixserve generate --attention-backend triton ...)"
            )
    elif device.type == "cuda" and interpreting:
        raise RuntimeError(
            "attention_backend 'triton' on CUDA: unset TRITON_INTERPRET to run compiled kernels"
        )
    elif device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"attention_backend 'triton' does not run on {device.type}")


class RowSplit(NamedTuple):
    """How one forward's sequences split between the kernels (host ints, computed once per forward)."""

    lead_decodes: int  # sequences 0 .. lead_decodes-1 are decode rows (rows 0 .. lead_decodes-1)
    extend_end: int  # sequences lead_decodes .. extend_end-1 go to the extend kernel
    max_extend: int  # longest extend among them (sizes the extend grid without a device sync)
    num_seqs: int  # sequences extend_end .. num_seqs-1 are trailing decode rows (the last rows)
    num_rows: int


def split_rows(extend_lens: list[int]) -> RowSplit:
    """Leading and trailing runs of one-row sequences go to the decode kernel, the rest to extend."""
    n = len(extend_lens)
    lead = 0
    while lead < n and extend_lens[lead] == 1:
        lead += 1
    end = n
    while end > lead and extend_lens[end - 1] == 1:
        end -= 1
    return RowSplit(lead, end, max(extend_lens[lead:end], default=0), n, sum(extend_lens))


class TritonPagedAttentionBackend(AttentionBackend):
    """Stores new K/V into a ``KVPool`` and attends over the paged history with Triton kernels."""

    # A decode forward launches the same kernels on the batch's tensors whatever their values.
    supports_graph_capture = True
    # Both kernels add each head's sink to its rows' denominators (gpt-oss).
    supports_sinks = True

    def __init__(self, pool: Any, num_sms: int | None = None) -> None:
        """``num_sms`` sets the decode split policy (default: the device's SM count; None on the CPU
        means one split, the interpreter's fastest)."""
        device = torch.device(pool.device)
        _ensure_runnable(device)
        import radixkernels
        from radixkernels.decode import device_num_sms

        self.num_sms = num_sms if num_sms is not None else device_num_sms(device)
        self.interpreted = device.type == "cpu"
        self.pool = pool
        self.fmt = pool.fmt
        self._store = radixkernels.store_kv
        self._decode = radixkernels.paged_decode_attention
        self._extend = radixkernels.extend_attention
        self._meta_batch: ForwardBatch | None = None
        self._split = split_rows([])

    def decode_splits(self, batch_size: int) -> int:
        """KV splits of a decode launch over ``batch_size`` sequences (a compile-time constant)."""
        from radixkernels.decode import num_kv_splits_for

        return (
            1
            if self.num_sms is None
            else num_kv_splits_for(batch_size, self.pool.kv_heads, self.num_sms)
        )

    def decode_batch_sizes(self, max_batch_size: int) -> list[int]:
        """The smallest decode batch size for each split count reachable up to ``max_batch_size``:
        a warm-up that runs these batches launches every decode variant the server can use."""
        first: dict[int, int] = {}
        for b in range(1, max_batch_size + 1):
            first.setdefault(self.decode_splits(b), b)
        return sorted(first.values())

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Per-forward facts from host data (which rows go to which kernel), computed once and
        reused by every layer."""
        assert batch.page_table is not None and batch.out_cache_loc is not None, (
            "paged backend needs a paged batch"
        )
        self._split = split_rows(batch.extend_lens_cpu)
        self._meta_batch = batch

    def _check_prepared(self, batch: ForwardBatch) -> None:
        prepared = self._meta_batch
        if prepared is None or (batch is not prepared and batch is not prepared.window_view):
            raise RuntimeError("call init_forward_metadata(batch) before the forward over it")

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
        self._check_prepared(batch)
        pool = self.pool
        ks = None if pool.k_scale is None else pool.k_scale[layer_id]
        vs = None if pool.v_scale is None else pool.v_scale[layer_id]
        self._store(
            pool.k_data[layer_id],
            pool.v_data[layer_id],
            ks,
            vs,
            k,
            v,
            batch.out_cache_loc,
            self.fmt,
        )
        return self._attend(layer_id, q, batch, sm_scale, window, softcap, sinks)

    @property
    def fuses_rope_store(self) -> bool:
        """Whether :meth:`forward_qkv` can rotate and store in one kernel (unquantized pools)."""
        from radixkernels.kv_format import KVCacheDtype

        return self.fmt.kv_dtype == KVCacheDtype.AUTO

    def forward_qkv(
        self,
        layer_id: int,
        qkv: torch.Tensor,  # [T, Hq + 2 Hkv, head_dim], not yet rotated
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [T, 1, head_dim] each
        num_q_heads: int,
        batch: ForwardBatch,
        sm_scale: float,
    ) -> torch.Tensor:
        """:meth:`forward` with RoPE fused into the KV store: one kernel rotates q (in place)
        and k and writes k and v to the pool, then attention as in :meth:`forward`."""
        from radixkernels.fused import rope_store_kv

        self._check_prepared(batch)
        pool = self.pool
        assert batch.out_cache_loc is not None
        q = rope_store_kv(
            qkv,
            *cos_sin,
            num_q_heads,
            pool.k_data[layer_id],
            pool.v_data[layer_id],
            batch.out_cache_loc,
            self.fmt,
        )
        return self._attend(layer_id, q, batch, sm_scale)

    def _attend(
        self,
        layer_id: int,
        q: torch.Tensor,
        batch: ForwardBatch,
        sm_scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the batch's rows over the pool, each row through its kernel (module
        docstring); both kernels take the layer's sliding window, soft-cap and sinks."""
        quirks: dict[str, Any] = {"window": window, "softcap": softcap, "sinks": sinks}
        sp = self._split
        pool = self.pool
        kd, vd = pool.k_data[layer_id], pool.v_data[layer_id]
        ks = None if pool.k_scale is None else pool.k_scale[layer_id]
        vs = None if pool.v_scale is None else pool.v_scale[layer_id]
        kv = (kd, vd, ks, vs, self.fmt)
        pt, lens = batch.page_table, batch.seq_lens
        assert pt is not None
        if sp.lead_decodes == sp.num_seqs:  # decode-only: one launch over the whole batch
            return self._decode(
                q,
                *kv,
                pt,
                lens,
                batch.page_size,
                sm_scale,
                num_kv_splits=self.decode_splits(sp.num_seqs),
                **quirks,
            )
        out = torch.empty_like(q)
        if sp.lead_decodes:
            a = sp.lead_decodes  # decode sequence b owns row b
            self._decode(
                q[:a],
                *kv,
                pt[:a],
                lens[:a],
                batch.page_size,
                sm_scale,
                num_kv_splits=self.decode_splits(a),
                out=out[:a],
                **quirks,
            )
        if sp.extend_end > sp.lead_decodes:
            a, e = sp.lead_decodes, sp.extend_end  # extend_start_loc holds absolute rows of q/out
            self._extend(
                q,
                *kv,
                pt[a:e],
                lens[a:e],
                batch.extend_lens[a:e],
                batch.extend_start_loc[a:e],
                batch.page_size,
                sm_scale,
                max_extend_len=sp.max_extend,
                out=out,
                **quirks,
            )
        if sp.num_seqs > sp.extend_end:
            e, r = (
                sp.extend_end,
                sp.num_rows - (sp.num_seqs - sp.extend_end),
            )  # trailing decodes own the last rows
            self._decode(
                q[r:],
                *kv,
                pt[e:],
                lens[e:],
                batch.page_size,
                sm_scale,
                num_kv_splits=self.decode_splits(sp.num_seqs - e),
                out=out[r:],
                **quirks,
            )
        return out
