"""Paged attention on the radixkernels Triton kernels (GPU; on the CPU through the interpreter).

Each layer call stores the step's new K/V rows into the pool (quantizing when the KV dtype
is quantized) and then runs one kernel over the whole batch::

    decode-only batch (every sequence has 1 new row)  -> paged_decode_attention (flash-decoding)
    anything else (prefill chunks, mixed batches)      -> extend_attention (decode rows are
                                                          extend rows of length 1 there)

Both read every position, the new ones included, back from the pool, so the quantized
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
from typing import Any

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
        raise RuntimeError("attention_backend 'triton' on CUDA: unset TRITON_INTERPRET to run compiled kernels")
    elif device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"attention_backend 'triton' does not run on {device.type}")


class TritonPagedAttentionBackend(AttentionBackend):
    """Stores new K/V into a ``KVPool`` and attends over the paged history with Triton kernels."""

    # A decode forward launches the same kernels on the batch's tensors whatever their values.
    supports_graph_capture = True

    def __init__(self, pool: Any) -> None:
        _ensure_runnable(torch.device(pool.device))
        import radixkernels

        self.pool = pool
        self.fmt = pool.fmt
        self._store = radixkernels.store_kv
        self._decode = radixkernels.paged_decode_attention
        self._extend = radixkernels.extend_attention
        self._meta_batch: ForwardBatch | None = None
        self._decode_only = False
        self._max_extend = 0

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Per-forward facts from host data, computed once and reused by every layer."""
        assert batch.page_table is not None and batch.out_cache_loc is not None, "paged backend needs a paged batch"
        self._decode_only = batch.is_decode_only
        self._max_extend = max(batch.extend_lens_cpu, default=0)
        self._meta_batch = batch

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        sm_scale: float,
    ) -> torch.Tensor:
        if self._meta_batch is not batch:
            raise RuntimeError("call init_forward_metadata(batch) before the forward over it")
        pool = self.pool
        kd, vd = pool.k_data[layer_id], pool.v_data[layer_id]
        ks = None if pool.k_scale is None else pool.k_scale[layer_id]
        vs = None if pool.v_scale is None else pool.v_scale[layer_id]
        self._store(kd, vd, ks, vs, k, v, batch.out_cache_loc, self.fmt)
        if self._decode_only:
            # Decode rows are in sequence order, one per sequence: q is [B, Hq, D].
            return self._decode(q, kd, vd, ks, vs, self.fmt, batch.page_table, batch.seq_lens, batch.page_size, sm_scale)
        return self._extend(
            q, kd, vd, ks, vs, self.fmt, batch.page_table, batch.seq_lens, batch.extend_lens,
            batch.extend_start_loc, batch.page_size, sm_scale, max_extend_len=self._max_extend,
        )
