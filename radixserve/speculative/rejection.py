"""Speculative rejection sampling: verify a sampled request's drafts so that its output has
exactly the distribution of sampling one token per step (Leviathan et al. 2023, Chen et al.
2023; what vLLM's and SGLang's rejection samplers do).

A verify forward gives a target distribution ``p_i`` (after temperature, top-k, min-p,
top-p and every logit edit the request asks for) for each of its ``k + 1`` rows; row ``i``
verifies draft ``d_(i+1)``, which the drafter proposed with probability ``q_i(d)``::

    rows:       t_last      d_1         ...   d_k
    verifies:   d_1         d_2         ...   (none: the bonus row)
    token:      d_1 with prob min(1, p_0(d_1) / q_0(d_1)),  else a draw from
                the residual normalize(max(p_0 - q_0, 0)); the bonus row draws from p_k

The request keeps the leading rows whose token is their draft, and the first row whose token
is not (a draw from its residual, which never holds the draft: a rejection means
``p(d) < q(d)``, so the residual is 0 at ``d``), or the bonus token when every draft stood:
:func:`~radixserve.speculative.verify.accepted_length` reads both cases off the tokens, as
for greedy. Each kept token then has exactly the target's distribution given the tokens
before it; rows after the first rejection are drawn and dropped (their randomness is
independent of the rows before, so computing every row at once and truncating is the
sequential algorithm).

A deterministic drafter (``ngram``, ``radix``) proposes a point mass, ``q = one_hot(d)``:
a draft stands with probability ``p(d)``, and a rejection draws from ``p`` with ``d``
removed. A drafter with a distribution of its own (a draft model) passes ``draft_probs``
and gets the general rule.

This is the one module of :mod:`radixserve.speculative` that touches tensors: the sampler
(:mod:`radixserve.engine.sampler`) calls it on the device, inside a step's sampling, with
uniforms it drew on the host (a seeded request draws them from its own generator).
"""

from __future__ import annotations

import torch

from radixserve.speculative.verify import NO_DRAFT

__all__ = ["NO_DRAFT", "inverse_cdf", "rejection_sample"]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs`` ``[R, V]`` (non-negative, rows need not sum to 1, each
    with some mass) from the uniforms ``u`` ``[R]`` in [0, 1): the first token whose
    cumulative mass passes ``u`` times the row's total (a token of zero mass is never drawn)."""
    cdf = probs.cumsum(dim=-1)
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def rejection_sample(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    u_accept: torch.Tensor,
    u_draw: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row: the row's draft if it stands, else a draw from the residual.

    ``probs`` ``[R, V]``: the target's processed probabilities (non-negative; each row is
    normalized here). ``drafts`` ``[R]`` int64: the token each row verifies, or
    :data:`NO_DRAFT` (the row then draws from ``probs`` as plain sampling does).
    ``u_accept``, ``u_draw`` ``[R]``: independent uniforms in [0, 1), the first for the
    accept test, the second for the draw. ``draft_probs`` ``[R, V]``: the drafter's
    distribution ``q`` of each row (rows without a draft are not read); None: each draft is a
    point mass (deterministic drafters). Device only: nothing here reads the device back."""
    p = probs.float()
    p = p / p.sum(dim=-1, keepdim=True)
    has = drafts >= 0
    d = drafts.clamp(min=0)[:, None]
    p_d = p.gather(1, d).squeeze(1)
    if draft_probs is None:
        q_d = has.to(p.dtype)
        residual = torch.where(has[:, None], p.scatter(1, d, 0.0), p)
    else:
        q = draft_probs.float() * has[:, None]
        q_d = q.gather(1, d).squeeze(1)
        residual = (p - q).clamp_(min=0.0)
    accept = has & (u_accept.to(p.dtype) * q_d < p_d)  # u < p(d) / q(d), without dividing
    # p == q up to rounding leaves no residual mass: the draft stands (it had probability ~1).
    accept |= has & (residual.sum(dim=-1) <= 0)
    return torch.where(accept, drafts, inverse_cdf(residual, u_draw))
