"""Speculative decoding of sampled requests in the engine (tiny random Llama, float32, ngram
drafter, temperature 0.8): drafts verified by rejection sampling keep the output
distribution of the plain engine, seeded requests repeat, rejected drafts' pages are freed
(the invariants after every step, every page back at the end); a sampler that keeps every
draft fails the same comparison.

A random model's next-token distribution is nearly flat over 512 tokens, where no draft
would ever stand; a logit bias narrows it to four tokens of unequal weight (a small
vocabulary), and the prompt holds every pair of them with a follower, so the ngram drafter
drafts at every decode step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import run_to_completion, tokens_of
from sampling_stats import same

from radixserve.engine import sampler
from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

# Tokens 10 to 13, in that order of weight (with the model's own logits, 10 is drawn about
# 70 % of the time, 13 about 3 %; any other token about once in 250 draws).
BIAS = {10: 10.0, 11: 9.4, 12: 8.8, 13: 8.2}
# A de Bruijn sequence of the four (every ordered pair once), twice: each pair has a follower.
CYCLE = [10, 10, 11, 10, 12, 10, 13, 11, 11, 12, 11, 13, 12, 12, 13, 13]
PROMPT = CYCLE * 2 + CYCLE[:1]
SEEDS = 256
GROUP = 8  # the most requests that draft together (speculative_disable_by_batch_size's default)
OUT = 4  # tokens per request: the first from the prefill, three verified


def _params(seed: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=OUT, temperature=0.8, seed=seed, logit_bias=BIAS, ignore_eos=True
    )


@pytest.fixture(scope="module")
def engines(tiny_llama_hd64_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    kw = {"dtype": "float32", "num_threads": 1, "num_pages": 256, "page_size": 4}
    base = Engine(tiny_llama_hd64_dir, **kw)
    spec = Engine(
        tiny_llama_hd64_dir, speculative_algorithm="ngram", speculative_num_tokens=4, **kw
    )
    yield base, spec
    base.close()
    spec.close()


def _run(engine: Engine, seeds: range) -> tuple[list[tuple[int, ...]], int, int]:
    """Each seed's output, in groups of ``GROUP`` (every step invariant-checked); and the
    tokens drafted and accepted."""
    outs: list[tuple[int, ...]] = []
    drafted = accepted = 0
    for lo in range(seeds.start, seeds.stop, GROUP):
        rids = [
            engine.add_request(PROMPT, _params(s)) for s in range(lo, min(lo + GROUP, seeds.stop))
        ]
        got = run_to_completion(engine)
        for rid in rids:
            outs.append(tuple(tokens_of(got[rid])))
            usage = got[rid][-1].usage
            assert usage is not None
            drafted += usage.spec_drafted_tokens
            accepted += usage.spec_accepted_tokens
    return outs, drafted, accepted


# What is compared between the engines: the verified positions 1 to 3 alone, and positions
# 1 and 2 with the token before each (the ngram draft for a position depends on it: a
# sampler keeping every draft piles these pairs onto four cells).
VIEWS = {
    "t1": lambda o: o[1],
    "t2": lambda o: o[2],
    "t3": lambda o: o[3],
    "t0 t1": lambda o: o[0:2],
    "t1 t2": lambda o: o[1:3],
}


def _differ(want: list[tuple[int, ...]], got: list[tuple[int, ...]]) -> list[str]:
    """The views in which ``got`` fails the two-sample chi-square against ``want``."""
    failed = []
    for name, view in VIEWS.items():
        a, b = Counter(map(view, want)), Counter(map(view, got))
        cells = sorted(set(a) | set(b), key=str)
        stat, critical = same([a[c] for c in cells], [b[c] for c in cells])
        if stat >= critical:
            failed.append(f"{name}: {stat:.1f} >= {critical:.1f}")
    return failed


@pytest.fixture(scope="module")
def plain(engines: tuple[Engine, Engine]) -> list[tuple[int, ...]]:
    """Every seed's output from the engine without speculation."""
    return _run(engines[0], range(SEEDS))[0]


def test_sampled_speculation_keeps_the_distribution(
    engines: tuple[Engine, Engine], plain: list[tuple[int, ...]]
) -> None:
    spec = engines[1]
    got, drafted, accepted = _run(spec, range(SEEDS))
    assert all(len(o) == OUT for o in got)
    assert 0 < accepted < drafted  # drafts ran; rejection sampling kept some, not all
    assert _differ(plain, got) == []
    # Every page back: rejected drafts' pages were freed, nothing leaked.
    assert spec.allocator.num_free + spec.cache.num_evictable_pages == spec.allocator.num_pages


def test_a_sampler_keeping_every_draft_fails_the_same_test(
    engines: tuple[Engine, Engine], plain: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def keep_drafts(
        probs: torch.Tensor, drafts: torch.Tensor, *_: object, **__: object
    ) -> torch.Tensor:
        return torch.where(drafts >= 0, drafts, probs.argmax(-1))

    monkeypatch.setattr(sampler, "rejection_sample", keep_drafts)
    got, drafted, accepted = _run(engines[1], range(SEEDS))
    assert accepted == drafted > 0
    assert len(_differ(plain, got)) >= 3


def test_seeded_sampled_speculation_repeats(engines: tuple[Engine, Engine]) -> None:
    _, spec = engines
    first, drafted, _ = _run(spec, range(2 * GROUP))
    again, _, _ = _run(spec, range(2 * GROUP))
    assert drafted > 0 and first == again
