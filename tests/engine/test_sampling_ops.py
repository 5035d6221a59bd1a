"""Top-p by threshold bisection (no sort) and penalty tables kept on the device between steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from radixserve.engine.sampler import Sampler
from radixserve.engine.sampling_ops import PenaltyCounts, PenaltyTables, greedy, top_p_keep
from radixserve.sampling_params import SamplingParams


def _sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The sort-based definition: keep a token while the mass strictly ahead of it is < p * total
    (masses in float64, so that the reference itself does not misplace the boundary)."""
    sorted_p, order = probs.double().sort(descending=True)
    before = sorted_p.cumsum(-1) - sorted_p
    keep_sorted = before < top_p * sorted_p.sum()
    return torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)


def test_top_p_keep_boundary_on_a_large_vocabulary() -> None:
    """49k-entry rows: the boundary token is decided in float64 (float32 sums err by ~1e-7)."""
    probs = torch.softmax(
        torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)) * 3, -1
    )
    keep = top_p_keep(probs, torch.full((64,), 0.9))
    for i in range(64):
        assert torch.equal(keep[i], _sorted_nucleus(probs[i], 0.9)), f"row {i}"


@pytest.mark.parametrize("seed", range(4))
def test_top_p_keep_equals_sorted_nucleus(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 1000, generator=g) * torch.tensor([0.5, 1, 2, 4, 8, 30.0])[:, None]
    probs = torch.softmax(logits, -1)
    probs[1, probs[1] < probs[1].max() * 0.01] = 0.0  # min-p zeroed some: rows need not sum to 1
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.1, 0.7, 0.3])
    keep = top_p_keep(probs, top_p)
    for i in range(6):
        assert torch.equal(keep[i], _sorted_nucleus(probs[i], float(top_p[i]))), f"row {i}"
    assert keep[5].sum() == 1  # a dominant token alone covers p


def test_sampler_top_p_does_not_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*a: Any, **k: Any) -> None:
        raise AssertionError("a full-vocabulary sort in the sampling step")

    for owner in (torch, torch.Tensor):
        monkeypatch.setattr(owner, "sort", no_sort)
        monkeypatch.setattr(owner, "argsort", no_sort)
    rows = [
        _Row(SamplingParams(top_p=0.8, top_k=50, temperature=0.7)),
        _Row(SamplingParams(top_p=0.3)),
    ]
    res = Sampler(64, seed=1).sample(torch.randn(2, 64), rows)
    assert len(res.token_ids) == 2


@dataclass(eq=False)
class _Row:
    params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [5, 6, 5, 9])
    prompt_len: int = 3
    generator: torch.Generator | None = None


def _expected(row: _Row, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[row.token_ids] = True
    counts = torch.zeros(vocab)
    for t in row.token_ids[row.prompt_len :]:
        counts[t] += 1
    return seen, counts


def _step(pc: PenaltyCounts, rows: list[_Row]) -> tuple[PenaltyTables, torch.Tensor]:
    """One step through both halves, the staged lists as tensors (what the sampler does)."""
    st = pc.plan(rows)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    slots = t(st.slots)
    tables = pc.apply(
        st,
        slots,
        t(st.reset) if st.reset else None,
        (t(st.add_slot), t(st.add_tok), t(st.add_out)) if st.add_slot else None,
    )
    return tables, slots


def test_penalty_tables_follow_the_rows_without_rebuilding() -> None:
    vocab = 40
    pc = PenaltyCounts(vocab, torch.device("cpu"), capacity=2)
    rows = [_Row(SamplingParams(repetition_penalty=1.3), token_ids=[1, 2, 3 + i]) for i in range(3)]
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        tables, slots = _step(pc, rows)  # 3 rows > capacity 2: the tables grow
        for j, r in enumerate(rows):
            seen, counts = _expected(r, vocab)
            assert torch.equal(tables.seen[j], seen) and torch.equal(tables.counts[j], counts), (
                step,
                j,
            )
        sampled = torch.randint(0, vocab, (3,), generator=g)
        pc.advance(slots, sampled)
        for r, tok in zip(rows, sampled.tolist()):
            r.token_ids.append(tok)
    assert pc.rebuilds == 3 and pc.capacity == 4  # each row counted from its history once
    # A history that does not continue what was counted (the sampled token never appended) is
    # rebuilt from the list.
    rows[0].token_ids.pop()
    tables, _ = _step(pc, rows[:1])
    assert torch.equal(tables.counts[0], _expected(rows[0], vocab)[1]) and pc.rebuilds == 4
    # More rows than free table rows: the least recently used entries make room.
    others = [
        _Row(SamplingParams(presence_penalty=1.0), token_ids=[7] * (i + 2), prompt_len=1)
        for i in range(4)
    ]
    tables, _ = _step(pc, others)
    assert pc.capacity == 4
    for j, r in enumerate(others):
        assert torch.equal(tables.counts[j], _expected(r, vocab)[1])
    assert torch.equal(
        _step(pc, rows[1:2])[0].seen[0], _expected(rows[1], vocab)[0]
    )  # evicted, rebuilt


def test_sampler_penalties_across_steps_match_recomputed() -> None:
    """Greedy picks under penalties, step after step, are those of the penalties recomputed from
    the token lists; the tables are built once."""
    vocab = 30
    s = Sampler(vocab, seed=3)
    params = SamplingParams(
        repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3, temperature=0.0
    )
    row = _Row(params, token_ids=[1, 2, 2], prompt_len=3)
    g = torch.Generator().manual_seed(4)
    for _ in range(6):
        logits = torch.randn(1, vocab, generator=g)
        seen, counts = _expected(row, vocab)
        want = torch.where(seen, torch.where(logits > 0, logits / 1.5, logits * 1.5), logits)
        want = want - (counts * 0.4 + (counts > 0).float() * 0.3)
        tok = s.sample(logits, [row]).token_ids[0]
        assert tok == int(want.argmax())
        row.token_ids.append(tok)
    assert s.penalty_counts.rebuilds == 1
    torch.testing.assert_close(
        s.processed_logits(logits, [row]),
        torch.where(
            _expected(row, vocab)[0], torch.where(logits > 0, logits / 1.5, logits * 1.5), logits
        )
        - (_expected(row, vocab)[1] * 0.4 + (_expected(row, vocab)[1] > 0).float() * 0.3),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    """First index among ties, NaN as the largest, all -inf rows: exactly argmax's answers."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (64, 1000), generator=g).to(dtype)  # many ties per row
    logits[5, 17] = float("nan")
    logits[6] = float("-inf")
    logits[7, 999] = float("inf")
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))
    assert greedy(logits)[5] == 17 and greedy(logits)[6] == 0
