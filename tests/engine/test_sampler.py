"""Batched sampler: each filter's semantics, penalties, seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from radixserve.engine.sampler import (
    Sampler,
    prompt_logprob_count,
    prompt_logprob_reads,
    unpack_prompt_logprobs,
)
from radixserve.sampling_params import SamplingParams

V = 32


@dataclass
class Row:
    params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    prompt_len: int = 3
    generator: torch.Generator | None = None


def sampler() -> Sampler:
    return Sampler(V, eos_token_ids=(0,), seed=0)


def draws(params: SamplingParams, logits: torch.Tensor, n: int = 400) -> set[int]:
    s = sampler()
    rows = [Row(params) for _ in range(n)]
    return set(s.sample(logits.expand(n, V).clone(), rows).token_ids)


def peaked() -> torch.Tensor:
    return torch.linspace(0, 6, V)[None, :]  # token 31 most likely, then 30, ...


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-7])
def test_a_tiny_temperature_is_greedy(temperature: float) -> None:
    """Dividing by a denormal temperature overflows float32 (NaN probabilities): below
    SAMPLING_EPS the row samples greedily instead."""
    logits = torch.randn(4, V)
    res = sampler().sample(logits, [Row(SamplingParams(temperature=temperature)) for _ in range(4)])
    assert res.token_ids == logits.argmax(-1).tolist()


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, V)
    res = sampler().sample(logits, [Row(SamplingParams(temperature=0.0)) for _ in range(5)])
    assert res.token_ids == logits.argmax(-1).tolist()
    assert res.logprobs == [None] * 5


def test_top_k_top_p_min_p_restrict_support() -> None:
    assert draws(SamplingParams(top_k=3), peaked()) == {29, 30, 31}
    assert draws(SamplingParams(top_k=1, temperature=5.0), peaked()) == {31}
    probs = torch.softmax(peaked()[0], -1)
    # top_p: the smallest set whose mass reaches p.
    order = probs.argsort(descending=True)
    k = int((probs[order].cumsum(0) < 0.6).sum()) + 1
    assert draws(SamplingParams(top_p=0.6), peaked()) == set(order[:k].tolist())
    allowed = set((probs >= 0.5 * probs.max()).nonzero().flatten().tolist())
    assert draws(SamplingParams(min_p=0.5), peaked()) == allowed
    assert len(draws(SamplingParams(temperature=1.0), peaked())) > 10


def test_mixed_batch_rows_are_independent() -> None:
    logits = peaked().expand(3, V).clone()
    rows = [
        Row(SamplingParams(temperature=0.0)),
        Row(SamplingParams(top_k=2)),
        Row(SamplingParams(temperature=0.0, logprobs=2)),
    ]
    res = sampler().sample(logits, rows)
    assert res.token_ids[0] == 31 and res.token_ids[2] == 31 and res.token_ids[1] in (30, 31)
    lp = torch.log_softmax(logits[2], -1)
    assert res.logprobs[0] is None and res.logprobs[1] is None
    chosen, top, asked = res.logprobs[2]  # type: ignore[misc]
    assert chosen == pytest.approx(lp[31].item())
    assert [t for t, _ in top] == [31, 30] and asked == []


def test_logprobs_of_the_tokens_a_row_names() -> None:
    """SGLang's token_ids_logprob: each row's named tokens' logprobs, in its order, from the
    model's distribution (before temperature and filters); rows naming different numbers of
    tokens, or none, side by side."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, V, generator=g) * 3
    rows = [
        Row(SamplingParams(temperature=0.0, logprobs=0, logprob_token_ids=[7, 3, 7])),
        Row(SamplingParams(temperature=0.7, top_k=3, logprobs=1, logprob_token_ids=[V - 1])),
        Row(SamplingParams(temperature=0.0)),
        Row(SamplingParams(temperature=0.0, logprobs=2)),
    ]
    res = sampler().sample(logits.clone(), rows)
    lp = torch.log_softmax(logits, -1)
    want = {0: [7, 3, 7], 1: [V - 1], 3: []}
    for i, ids in want.items():
        chosen, _, asked = res.logprobs[i]  # type: ignore[misc]
        assert chosen == pytest.approx(lp[i, res.token_ids[i]].item())
        assert asked == pytest.approx([lp[i, t].item() for t in ids])
    assert res.logprobs[2] is None


def test_per_request_seed_reproducible() -> None:
    s = sampler()
    logits = torch.zeros(1, V)

    def run(seed: int) -> list[int]:
        row = Row(SamplingParams(temperature=1.0, seed=seed), generator=s.new_generator(seed))
        return [s.sample(logits.clone(), [row]).token_ids[0] for _ in range(20)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0] + [0.0] * (V - 3)])
    row = Row(
        SamplingParams(temperature=0.0, repetition_penalty=4.0), token_ids=[0, 1], prompt_len=2
    )
    s = sampler()
    out = s.processed_logits(logits, [row])
    assert out[0, :3].tolist() == [0.5, -8.0, 1.0]  # seen tokens: positive / p, negative * p


def test_frequency_presence_penalty_on_output_only() -> None:
    logits = torch.zeros(1, V)
    row = Row(
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
        token_ids=[4, 5, 5, 6],
        prompt_len=1,
    )
    out = sampler().processed_logits(logits, [row])
    assert out[0, 4].item() == 0.0  # prompt token: untouched
    assert out[0, 5].item() == pytest.approx(-(2 * 0.5 + 1.0))
    assert out[0, 6].item() == pytest.approx(-(0.5 + 1.0))


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, V)
    logits[0, 0] = 10.0  # eos
    logits[0, 7] = 9.0  # a stop id
    row = Row(
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]),
        token_ids=[1, 2, 3, 9],
        prompt_len=3,
    )
    assert sampler().sample(logits, [row]).token_ids == [
        1
    ]  # first of the remaining all-zero logits
    row.token_ids.append(9)  # two outputs now: eos allowed again
    assert sampler().sample(logits, [row]).token_ids == [0]


@pytest.mark.parametrize("top_k", [0, 3])
def test_prompt_logprobs_and_their_top_k(top_k: int) -> None:
    logits = torch.randn(4, V)
    targets = torch.tensor([1, 5, 0, 31])
    lp = torch.log_softmax(logits, -1)
    asked = [[7, 1], [], [3], [0, 0, 2]]  # each row's named tokens (padded with 0 below)
    padded = torch.tensor([ids + [0] * (3 - len(ids)) for ids in asked])
    reads = prompt_logprob_reads(logits, targets, top_k, padded)
    assert len(reads) == prompt_logprob_count(top_k, asked=True)
    host = [t.double().reshape(-1).tolist() for t in reads]  # as the one read back holds them
    chosen, tops, ranks, named = unpack_prompt_logprobs(host, top_k, asked)
    assert named == [pytest.approx([lp[r, t].item() for t in ids]) for r, ids in enumerate(asked)]
    assert chosen == pytest.approx(lp[torch.arange(4), targets].tolist())
    scored = lp[torch.arange(4), targets]
    assert ranks == [int((row > v).sum()) + 1 for row, v in zip(lp, scored)]
    assert len(tops) == (4 if top_k else 0)
    for row, top in zip(lp, tops):
        values, ids = row.topk(top_k)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist())
