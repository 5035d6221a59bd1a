"""Micro-batches: one step's sequences cut into groups that follow each other down the pipe.

With one batch per step, stage ``s`` waits while the stages before it compute (the bubble).
Cutting the step's sequences into ``k`` contiguous groups lets stage 0 compute group ``i + 1``
while stage 1 computes group ``i`` (GPipe's schedule inside one step)::

    stage 0:  [g0][g1][g2]
    stage 1:      [g0][g1][g2]          busy 3 of 4 slots instead of 1 of 2

Every rank cuts the same plan the same way (a pure function of the plan), so no extra message
is needed. Groups are whole sequences (a sequence's rows, its KV pages and its logits stay in
one group), with about equal rows. The scheduler is unchanged: micro-batches of *different*
steps (SGLang's ``pp_size`` running batches) would also hide the sampling and the next
schedule, but need the scheduler to keep disjoint running batches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixserve.model.forward_batch import ForwardBatch
from radixserve.scheduling.plan import StepPlan

__all__ = ["MicroBatch", "split_micro_batches", "sub_batch"]


class MicroBatch(NamedTuple):
    """Sequences ``[seq_lo, seq_hi)`` of a plan, its rows ``[row_lo, row_hi)``, and which of the
    plan's ``logits_indices`` (positions in that list) fall in those rows."""

    seq_lo: int
    seq_hi: int
    row_lo: int
    row_hi: int
    logits: list[int]

    @property
    def num_rows(self) -> int:
        return self.row_hi - self.row_lo


def split_micro_batches(plan: StepPlan, n: int) -> list[MicroBatch]:
    """Up to ``n`` contiguous groups of the plan's sequences, cut near equal row counts."""
    num_seqs = plan.batch_size
    n = max(1, min(n, num_seqs))
    starts = [0]
    for e in plan.extend_lens:
        starts.append(starts[-1] + e)
    total = starts[-1]
    cuts = [0]
    for k in range(1, n):
        target = total * k / n
        b = cuts[-1] + 1
        while b < num_seqs - (n - k) and starts[b] < target:
            b += 1
        cuts.append(b)
    cuts.append(num_seqs)
    groups = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        r_lo, r_hi = starts[lo], starts[hi]
        sel = [i for i, row in enumerate(plan.logits_indices) if r_lo <= row < r_hi]
        groups.append(MicroBatch(lo, hi, r_lo, r_hi, sel))
    return groups


def sub_batch(full: ForwardBatch, mb: MicroBatch, logits_indices: torch.Tensor) -> ForwardBatch:
    """The :class:`ForwardBatch` of ``mb``'s sequences (views of ``full``'s tensors);
    ``logits_indices`` are relative to ``mb.row_lo``."""
    s, r = slice(mb.seq_lo, mb.seq_hi), slice(mb.row_lo, mb.row_hi)
    assert full.page_table is not None and full.out_cache_loc is not None
    return ForwardBatch(
        input_ids=full.input_ids[r],
        positions=full.positions[r],
        seq_lens=full.seq_lens[s],
        extend_lens=full.extend_lens[s],
        prefix_lens=full.prefix_lens[s],
        extend_start_loc=full.extend_start_loc[s] - mb.row_lo,
        logits_indices=logits_indices,
        seq_lens_cpu=full.seq_lens_cpu[s],
        extend_lens_cpu=full.extend_lens_cpu[s],
        out_cache_loc=full.out_cache_loc[r],
        page_table=full.page_table[s],
        page_size=full.page_size,
        page_lists_cpu=None if full.page_lists_cpu is None else full.page_lists_cpu[s],
    )
