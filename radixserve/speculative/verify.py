"""Verification of a chain of drafted tokens (greedy here; sampled: :mod:`.rejection`).

A verify forward runs a request's last token and its ``k`` drafts as ``k + 1`` rows::

    rows:     t_last   d_1   d_2   ...  d_k
    argmax:   g_0      g_1   g_2   ...  g_k       (g_i: the model's token after row i)

``d_1`` stands if ``g_0 == d_1``; then ``d_2`` if ``g_1 == d_2``, and so on. With ``a`` drafts
standing, the request gains ``g_0 .. g_a``: the ``a`` accepted drafts (which equal
``g_0 .. g_(a-1)``) and the model's own token after them, ``a + 1`` tokens for one forward,
each the token plain greedy decoding would have produced there (given row-invariant
logits, which the runner guarantees for verify steps).

A sampled request's rows come out of rejection sampling
(:func:`~radixserve.speculative.rejection.rejection_sample`): row ``i``'s token is ``d_(i+1)``
when that draft stood and something else when it did not, so the same count applies.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NO_DRAFT", "accepted_length"]

NO_DRAFT = -1  # a sample row that verifies no draft (a bonus row, or a request that drafted none)


def accepted_length(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading ``drafts`` the model's ``targets`` (one per row, ``len(drafts) + 1``
    of them: greedy tokens, or rejection sampling's) agree with."""
    a = 0
    for d, g in zip(drafts, targets):
        if d != g:
            break
        a += 1
    return a
