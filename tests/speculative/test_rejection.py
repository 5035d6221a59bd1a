"""Rejection sampling (radixserve.speculative.rejection) keeps the target distribution, on a
6-token vocabulary with fixed targets and drafts, 20 000 draws a case, fixed seeds: the
chi-square test at significance 0.001 passes for the real sampler and fails for wrong ones
(a draft always kept; a residual without the max; a residual that keeps the draft)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from sampling_stats import fits

from radixserve.engine.sampler import Sampler
from radixserve.sampling_params import SamplingParams
from radixserve.speculative.rejection import NO_DRAFT, inverse_cdf, rejection_sample

N = 20_000
P = [0.4, 0.25, 0.15, 0.12, 0.08, 0.0]  # a target with a token of no mass (top-k'd away)
Q = [0.1, 0.1, 0.3, 0.2, 0.2, 0.1]  # a draft model that disagrees with it

Sample = Callable[..., torch.Tensor]


def _always_accept(
    p: torch.Tensor,
    drafts: torch.Tensor,
    u_acc: torch.Tensor,
    u: torch.Tensor,
    q: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.where(drafts >= 0, drafts, inverse_cdf(p, u))


def _residual_without_max(
    p: torch.Tensor,
    drafts: torch.Tensor,
    u_acc: torch.Tensor,
    u: torch.Tensor,
    q: torch.Tensor | None = None,
) -> torch.Tensor:
    p = p / p.sum(-1, keepdim=True)
    d = drafts.clamp(min=0)[:, None]
    q = torch.zeros_like(p).scatter(1, d, 1.0) if q is None else q
    accept = u_acc * q.gather(1, d).squeeze(1) < p.gather(1, d).squeeze(1)
    return torch.where(accept, drafts, inverse_cdf(p - q, u))


def _residual_keeps_draft(
    p: torch.Tensor,
    drafts: torch.Tensor,
    u_acc: torch.Tensor,
    u: torch.Tensor,
    q: torch.Tensor | None = None,
) -> torch.Tensor:
    p = p / p.sum(-1, keepdim=True)
    d = drafts.clamp(min=0)[:, None]
    q_d = torch.ones(len(p)) if q is None else q.gather(1, d).squeeze(1)
    accept = u_acc * q_d < p.gather(1, d).squeeze(1)
    return torch.where(accept, drafts, inverse_cdf(p, u))


def _uniforms(seed: int, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g, dtype=torch.float64), torch.rand(
        n, generator=g, dtype=torch.float64
    )


def _counts(tokens: torch.Tensor, v: int = len(P)) -> list[int]:
    return torch.bincount(tokens, minlength=v).tolist()


def _passes(tokens: torch.Tensor, target: list[float]) -> bool:
    counts = _counts(tokens)
    if any(c and not p for c, p in zip(counts, target)):
        return False  # a token of no mass drawn
    stat, critical = fits(counts, target)
    return stat < critical


def _point_mass(sample: Sample, draft: int, seed: int) -> torch.Tensor:
    u_acc, u = _uniforms(seed)
    drafts = torch.full((N,), draft, dtype=torch.int64)
    return sample(torch.tensor([P] * N), drafts, u_acc, u)


def _draft_model(sample: Sample, seed: int) -> torch.Tensor:
    """Drafts drawn from ``Q`` (as a draft model would), verified with ``Q`` given."""
    u_acc, u = _uniforms(seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.tensor([Q] * N)
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1)
    return sample(torch.tensor([P] * N), drafts, u_acc, u, q)


@pytest.mark.parametrize("draft", [0, 3, 5])  # likely, unlikely, impossible under P
def test_point_mass_drafts_keep_the_target_distribution(draft: int) -> None:
    tokens = _point_mass(rejection_sample, draft, seed=draft)
    assert _passes(tokens, P)
    # Acceptance is p(draft): the draft is the token exactly that often.
    assert abs((tokens == draft).float().mean().item() - P[draft]) < 0.02


def test_draft_distribution_keeps_the_target_distribution() -> None:
    assert _passes(_draft_model(rejection_sample, seed=7), P)


@pytest.mark.parametrize(
    "wrong",
    [_always_accept, _residual_without_max, _residual_keeps_draft],
    ids=lambda f: f.__name__,
)
def test_wrong_samplers_fail_the_same_test(wrong: Sample) -> None:
    assert not _passes(_point_mass(wrong, 0, seed=0), P)
    assert not _passes(_draft_model(wrong, seed=7), P)


def test_a_chain_keeps_each_position_and_the_bonus_token() -> None:
    """One verify of two drafts per request, targets per position: the first token follows
    p_0, the second (where the first draft stood) p_1, the bonus (both stood) p_2."""
    targets = [P, [0.1, 0.5, 0.1, 0.1, 0.1, 0.1], [0.3, 0.0, 0.3, 0.0, 0.4, 0.0]]
    drafts = [1, 1]  # point masses: d_1 = 1 (p_0 = 0.25), d_2 = 1 (p_1 = 0.5)
    u_acc, u = _uniforms(11, 3 * N)
    rows = torch.tensor(targets * N)
    out = rejection_sample(rows, torch.tensor([*drafts, NO_DRAFT] * N), u_acc, u).view(N, 3)
    first_stood = out[:, 0] == drafts[0]
    both_stood = first_stood & (out[:, 1] == drafts[1])
    for tokens, target in (
        (out[:, 0], targets[0]),
        (out[first_stood, 1], targets[1]),
        (out[both_stood, 2], targets[2]),
    ):
        assert _passes(tokens, target)
    assert 0.2 * N < first_stood.sum() < 0.3 * N and both_stood.sum() > 0.1 * N


class _Row:
    """What the sampler reads of a request."""

    def __init__(self, params: SamplingParams, seed: int | None = None) -> None:
        self.params = params
        self.token_ids = [0]
        self.prompt_len = 1
        self.grammar = None
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)


def test_the_sampler_verifies_sampled_rows_on_their_processed_distribution() -> None:
    """Through the sampler: temperature and top-k make the target; drafted rows keep it; a
    greedy row with a draft takes the argmax; seeded rows repeat their draws."""
    n, v = 4000, 8
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0]] * n)
    params = SamplingParams(temperature=0.8, top_k=5)
    target = torch.softmax(logits[0] / 0.8, -1)
    target[target < target.topk(5).values[-1]] = 0.0
    target = (target / target.sum()).tolist()
    sampler = Sampler(v, seed=3)
    drafts = [1] * n
    tokens = sampler.sample(logits, [_Row(params) for _ in range(n)], drafts).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=v).tolist()
    assert all(c == 0 for c, p in zip(counts, target) if p == 0)
    stat, critical = fits(counts, target)
    assert stat < critical
    greedy = sampler.sample(logits[:1], [_Row(SamplingParams(temperature=0.0))], [1])
    assert greedy.token_ids == [7]
    seeded = [sampler.sample(logits[:50], [_Row(params, seed=5)] * 50, [1] * 50) for _ in "ab"]
    assert seeded[0].token_ids == seeded[1].token_ids
