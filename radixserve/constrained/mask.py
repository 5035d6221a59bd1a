"""Applying the constrained rows' token masks to one step's logits, in one batched call.

::

    logits [B, vocab]          bitmask [B, words] int32 (all ones on unconstrained rows)
    row 0  unconstrained   ──  ignored (not in ``indices``)
    row 1  regex           ──  matcher.next_mask   ─┐ one kernel over the listed rows:
    row 2  unconstrained   ──  ignored              │ disallowed tokens -> -inf
    row 3  json_schema     ──  matcher.next_mask   ─┘

Unconstrained rows are never touched, so their samples are exactly what they would be
without the constrained requests in the batch. On the CPU the kernel is xgrammar's C++
one; on a GPU its Triton one (the masks are filled on the CPU and copied over once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from radixserve.constrained.matcher import GrammarMatcher


def apply_token_masks(
    logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher]
) -> None:
    """Set the logits of tokens the grammar forbids to ``-inf``, in place, for ``rows`` only.

    ``logits``: ``[B, vocab]`` float32; ``rows[i]`` is the row of ``matchers[i]``.
    """
    if not rows:
        return
    words = matchers[0].next_mask.shape[1]
    bitmask = torch.full((logits.shape[0], words), -1, dtype=torch.int32)
    bitmask[list(rows)] = torch.cat([m.next_mask for m in matchers])
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    apply_bitmask(logits, bitmask)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Apply a full ``[B, words]`` int32 bitmask (already on ``logits``' device) in place.

    Rows whose words are all ones are left exactly as they are, so no row list is needed
    (a list of indices would be one more host-to-device copy on a GPU).
    """
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
