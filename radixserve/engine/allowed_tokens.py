"""The sampler's ``allowed_token_ids`` stage (vLLM's field): a row draws from its listed tokens only.

Staged on the host as (row, token) pairs of the rows that list tokens, so a batch where one
request limits its tokens costs the others nothing; on the device every other token of
those rows is masked to ``-inf``, before the biases and the draw (see
:mod:`radixserve.engine.sampler`). ``min_tokens`` blocks the end tokens until the output is
long enough: where a row's allowed tokens are all end tokens it cannot, and its draw keeps
them (:func:`only_end_tokens`), rather than having nothing left to draw from.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from radixserve.engine.staging import Staged, StagingLayout
from radixserve.sampling_params import SamplingParams


def stage_allowed(params: Sequence[SamplingParams], layout: StagingLayout) -> int:
    """Stage the rows that list allowed tokens, and their (row, token) pairs; return how
    many such rows."""
    rows: list[int] = []
    pair_rows: list[int] = []
    toks: list[int] = []
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            pair_rows += [len(rows)] * len(p.allowed_token_ids)
            toks += p.allowed_token_ids
            rows.append(i)
    if rows:
        layout.ints("s.allow_rows", rows)
        layout.ints("s.allow_i", pair_rows)
        layout.ints("s.allow_t", toks)
    return len(rows)


def apply_allowed(logits: torch.Tensor, num_rows: int, staged: Staged) -> None:
    """Mask every token but the staged ones of their rows (``logits``: ``[B, vocab]``)."""
    rows = staged.i("s.allow_rows")
    keep = torch.zeros(num_rows, logits.shape[1], dtype=torch.bool, device=logits.device)
    keep[staged.i("s.allow_i"), staged.i("s.allow_t")] = True
    sub = logits.index_select(0, rows).masked_fill_(~keep, float("-inf"))
    logits.index_copy_(0, rows, sub)


def only_end_tokens(params: SamplingParams, end_ids: Collection[int]) -> bool:
    """Whether every token ``params`` allows is one of ``end_ids`` (so ``min_tokens`` cannot
    block them all)."""
    allowed = params.allowed_token_ids
    return bool(allowed) and all(t in end_ids for t in allowed or ())
