"""The sampler's ``logit_bias`` stage: staged on the host, added on the device.

Only the (row, token, bias) triples of rows that set a bias travel (at most 300 a row),
so a batch where one request biases costs the others nothing; the add is one
``index_put_`` into the step's logits, before temperature and the grammar mask (see
:mod:`radixserve.engine.sampler`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.engine.staging import Staged, StagingLayout
from radixserve.sampling_params import SamplingParams


def stage_bias(params: Sequence[SamplingParams], layout: StagingLayout, vocab_size: int) -> int:
    """Stage every row's biases into ``layout``; return how many (row, token) pairs."""
    rows: list[int] = []
    toks: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        for t, b in (p.logit_bias or {}).items():
            if 0 <= t < vocab_size and b:
                rows.append(i)
                toks.append(t)
                vals.append(b)
    if rows:
        layout.ints("s.bias_r", rows)
        layout.ints("s.bias_t", toks)
        layout.floats("s.bias_v", vals)
    return len(rows)


def apply_bias(logits: torch.Tensor, staged: Staged) -> None:
    """Add the staged biases to ``logits`` (``[B, vocab]`` float32) in place."""
    values = staged.f("s.bias_v").to(logits.dtype)
    logits.index_put_((staged.i("s.bias_r"), staged.i("s.bias_t")), values, accumulate=True)
