"""The ``draft`` drafter: a smaller model of the same vocabulary proposes the next tokens.

For each request that may draft, the draft model (greedy, argmax) runs on its own KV
(:class:`~radixserve.speculative.draft_kv.DraftKV`: its own pool, allocator and radix cache,
namespace-keyed like the target's)::

    rollback     drop the drafts the target rejected last step (their pages freed)
    catch up     feed the request's tokens the draft has not seen: the rest of the prompt
                 (first draft; after a cached prefix), then the tokens accepted since
    draft        the last row's argmax is d1; feed d1 -> d2; ... up to d_k (d_k is never fed)

Kernels: the prompt's rows run in chunks on the kernels their size picks (as the target's
prompt prefill does), every row after the prompt on the one-row kernel (as the target's
decode and verify rows do, ``plan.row_paths``). With the target itself as draft, every draft
then equals the target's own next token: acceptance is 100 %, which the tests use to check
that the draft's KV, positions and rollback are right.

The draft's distribution: :meth:`DraftModelDrafter.proposal` keeps the logits (float32,
``[len(tokens), vocab]``) of each request's last proposal, for a sampled acceptance rule
(:class:`DraftProposal`'s ``probs``). The proposal itself is greedy.

Runs one request at a time on the CPU (speculation runs there); batching the drafting of
several requests into one forward per draft token is a later step.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, NamedTuple

import torch

from radixserve.memory.pool import KVPool
from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend
from radixserve.model.cpu_linear import RowInvariantLinears
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.llama import LlamaForCausalLM
from radixserve.speculative.draft_kv import DraftKV, DraftSeq
from radixserve.speculative.drafter import Drafter, DraftSource

__all__ = ["DraftModelDrafter", "DraftProposal"]


class DraftProposal(NamedTuple):
    """One proposal: the drafted tokens and the draft model's logits that chose each
    (row ``i`` scored ``tokens[i]``)."""

    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), vocab] float32

    def probs(self, temperature: float = 1.0) -> torch.Tensor:
        """The draft's distribution ``q`` over the vocabulary at each drafted position."""
        return torch.softmax(self.logits / max(temperature, 1e-6), dim=-1)


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_pages: int,
        page_size: int,
        prefill_chunk: int,
        keep_logits: bool = True,
    ) -> None:
        """``model``: the loaded draft model; ``num_pages`` pages of ``page_size`` tokens of its
        KV; ``prefill_chunk``: most prompt tokens per draft forward."""
        self.model = model
        lc = model.local_config
        self.pool = KVPool(
            num_layers=lc.num_layers,
            num_pages=num_pages,
            page_size=page_size,
            kv_heads=lc.num_kv_heads,
            head_dim=lc.head_dim,
            act_dtype=model.dtype,
            device=model.device,
        )
        self.kv = DraftKV(num_pages, page_size)
        self.attn = TorchPagedAttentionBackend(self.pool)
        inv = RowInvariantLinears(model) if model.device.type == "cpu" else None
        self.one_row = inv if inv is not None and inv.complete else None
        self.prefill_chunk = max(1, prefill_chunk)
        self.keep_logits = keep_logits
        self._last: dict[str, DraftProposal] = {}

    # ---------------------------------------------------------------- Drafter

    def propose(self, req: DraftSource, k: int) -> list[int]:
        context = req.token_ids
        kv = self.kv
        seq = kv.open(req.request_id, req.namespace, context)
        kv.rollback(seq, context)
        start = len(seq.tokens)
        if start >= len(context):  # nothing new since the last draft: no logits to start from
            return []
        if not kv.reserve(seq, len(context) - start + k - 1):
            return []
        prompt_end = min(req.prompt_len, len(context) - 1)
        while start < prompt_end:  # the prompt's rows, on the kernels their chunk size picks
            n = min(self.prefill_chunk, prompt_end - start)
            self._forward(seq, context[start : start + n], start, one_row=False)
            kv.computed(seq, context[start : start + n], real=True)
            start += n
        rows = context[start:]
        logits = self._forward(seq, rows, start, one_row=True)
        kv.computed(seq, rows, real=True)
        tokens: list[int] = []
        scores: list[torch.Tensor] = []
        while True:
            tok = int(logits.argmax())
            tokens.append(tok)
            scores.append(logits)
            if len(tokens) == k:
                break
            logits = self._forward(seq, [tok], len(seq.tokens), one_row=True)
            kv.computed(seq, [tok], real=False)
        if self.keep_logits:
            self._last[req.request_id] = DraftProposal(tokens, torch.stack(scores))
        return tokens

    def finished(self, req: DraftSource) -> None:
        self._last.pop(req.request_id, None)
        self.kv.release(req.request_id, _known(req.token_ids))

    def reset(self) -> None:
        """The target's cache was flushed (no request is running): drop the draft's too."""
        assert not self.kv.seqs, "reset while requests hold draft KV"
        self.kv.cache.reset()

    def pool_stats(self) -> dict[str, Any]:
        alloc = self.kv.allocator
        return {
            "spec_draft_pages": alloc.num_pages,
            "spec_draft_pages_free": alloc.num_free,
            "spec_draft_pages_evictable": self.kv.cache.num_evictable_pages,
            "spec_draft_pool_bytes": self.pool.nbytes,
        }

    def check_invariants(self, live: Iterable[str]) -> None:
        self.kv.check_invariants(live)
        assert set(self._last) <= set(self.kv.seqs)

    # ---------------------------------------------------------------- introspection

    def proposal(self, request_id: str) -> DraftProposal | None:
        """The request's last proposal and the logits behind it (None: none kept)."""
        return self._last.get(request_id)

    @property
    def tracked(self) -> int:
        """Requests holding draft KV (tests: none once every request finished)."""
        return len(self.kv.seqs)

    def namespaces(self) -> list[Hashable | None]:
        """Namespaces with cached draft prefixes (tests)."""
        return list(self.kv.cache._roots)

    # ---------------------------------------------------------------- one forward

    def _forward(self, seq: DraftSeq, ids: list[int], start: int, one_row: bool) -> torch.Tensor:
        """Feed ``ids`` at positions ``start ..`` of ``seq`` (pages reserved); the last row's
        logits ``[vocab]``."""
        n = len(ids)
        ps = self.pool.page_size
        total = start + n
        pages = seq.pages[: -(-total // ps)]
        dev = self.pool.device
        i32, i64 = torch.int32, torch.int64
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=i64, device=dev),
            positions=torch.arange(start, total, dtype=i64, device=dev),
            seq_lens=torch.tensor([total], dtype=i32, device=dev),
            extend_lens=torch.tensor([n], dtype=i32, device=dev),
            prefix_lens=torch.tensor([start], dtype=i32, device=dev),
            extend_start_loc=torch.zeros(1, dtype=i32, device=dev),
            logits_indices=torch.tensor([n - 1], dtype=i64, device=dev),
            seq_lens_cpu=[total],
            extend_lens_cpu=[n],
            out_cache_loc=torch.tensor(self.kv.slots(seq, start, n), dtype=i64, device=dev),
            page_table=torch.tensor([pages], dtype=i32, device=dev),
            page_size=ps,
            page_lists_cpu=[pages],
        )
        self.attn.init_forward_metadata(batch)
        inv = self.one_row if one_row else None
        if inv is not None:
            inv.on("gemv")
        try:
            return self.model.forward(batch, self.attn)[0]
        finally:
            if inv is not None:
                inv.off()


def _known(tokens: list[int]) -> list[int]:
    """``tokens`` up to a placeholder of a step in flight (ids are never negative)."""
    end = len(tokens)
    while end and tokens[end - 1] < 0:
        end -= 1
    return tokens[:end]
