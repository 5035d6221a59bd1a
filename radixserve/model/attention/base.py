"""The interface between the model's layers and an attention implementation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.native import AttentionPlan


@dataclass(frozen=True)
class NativeLayersPlan:
    """What a forward that runs all its layers in one CPU call needs from the backend: the
    step's attention plans (the global layers' first, then one per sliding window), each
    plan's KV slots for the rows (a window pool's where its layers' KV lives there), the
    plan each layer attends through, and each layer's K and V pages, with their scales where
    the pages hold int8 or fp8 codes (empty lists: unquantized pages)."""

    plans: list[AttentionPlan]
    slots: list[torch.Tensor]
    layer_plans: list[int]
    k_pages: list[torch.Tensor]
    v_pages: list[torch.Tensor]
    k_scales: list[torch.Tensor] = field(default_factory=list)
    v_scales: list[torch.Tensor] = field(default_factory=list)


class AttentionBackend(ABC):
    """Computes attention for every layer of one model over a :class:`ForwardBatch`.

    The model calls :meth:`forward` once per layer with that layer's projected, rotated
    q/k/v for the batch's new rows. A paged backend first stores ``k``/``v`` into the KV
    pool at ``batch.out_cache_loc`` and then attends over each sequence's whole history
    (cached prefix + new rows, causal within the new rows); the dense backend attends
    causally within each sequence's rows only. GQA/MQA: ``num_q_heads`` is a multiple
    of ``num_kv_heads`` (not necessarily a power of two).

    Per-step metadata (index plans, masks, kernel choices) comes through one explicit call,
    :meth:`init_forward_metadata`, made by the model runner before the forward (SGLang's
    name): every layer then reuses it. A paged backend refuses a batch it was not prepared
    for rather than noticing a new batch object on its own.
    """

    # Whether a forward reads only the batch's tensors (no host metadata per step), so that a
    # decode forward over static buffers can be captured in a CUDA graph and replayed.
    supports_graph_capture = False
    # Whether the kernels run in an interpreter (Triton's, on the CPU): warm-up then has nothing
    # to compile, and its long prefills would only cost time (ModelRunner.warm_up).
    interpreted = False
    # Whether :meth:`forward` applies attention sinks (gpt-oss); a model with sinks is refused
    # at start-up on a backend without them (``ModelRunner``), never attended without.
    supports_sinks = False

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build whatever every layer of the next forward over ``batch`` shares (host lists
        only: never read the device). The default has nothing to build; backends with
        per-batch metadata override it (deliberately not abstract)."""
        return

    def native_layers_plan(
        self, batch: ForwardBatch, windows: Sequence[int | None]
    ) -> NativeLayersPlan | None:
        """For the CPU's one-call decoder stack (``model/decoder_stack.py``): the plans and
        pages of ``batch`` for layers with ``windows`` (each layer's sliding window, None:
        global) when this backend attends through the CPU kernel (``native.paged_attention``,
        over unquantized, int8 or fp8 pages); None (the default) keeps the per-layer forward."""
        return None

    @property
    def fuses_rope_store(self) -> bool:
        """Whether :meth:`forward_qkv` is available (RoPE fused into the KV store)."""
        return False

    def forward_qkv(
        self,
        layer_id: int,
        qkv: torch.Tensor,  # [T, Hq + 2 Hkv, head_dim], not yet rotated
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [T, 1, head_dim] each
        num_q_heads: int,
        batch: ForwardBatch,
        sm_scale: float,
    ) -> torch.Tensor:
        """:meth:`forward` from the unrotated fused projection: rotates q and k, stores k and
        v, attends. Only where :attr:`fuses_rope_store` says so (the Triton backend)."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse RoPE into the KV store")

    @abstractmethod
    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        batch: ForwardBatch,
        sm_scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return the attention output, ``[T, num_q_heads, head_dim]`` in ``q``'s dtype.

        ``window``: the layer's sliding window (a row sees only the last ``window``
        positions, its own included); ``softcap``: scores become ``softcap * tanh(s /
        softcap)`` before the softmax (see ``windowed.py``); ``sinks`` ``[num_q_heads]``
        float32: each head's sink logit joins every row's softmax denominator (gpt-oss;
        ``windowed.py``). A backend that cannot honour any of them raises rather than attend
        without it."""
