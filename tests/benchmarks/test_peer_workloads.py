"""The peer benchmarks' workload generators: determinism and optimal-hit-rate arithmetic.

Fast (a fake character tokenizer, no model): the optimum is what an unbounded ideal
prefix cache reuses, page-aligned, never the last prompt token.
"""

from __future__ import annotations

import bench_modules
import pytest

wl = bench_modules.load("workloads.py", "peer_workloads")


class CharTokenizer:
    """One token per character; ChatML-like rendering with one marker token per role."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids: list[int] = []
        for m in messages:
            ids += [1000 + len(m["role"])] + self.encode(m["content"]) + [2]
        if add_generation_prompt:
            ids.append(1009)
        return {"input_ids": ids}


def test_optimal_hit_rate_arithmetic() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [1, 2, 3, 4, 5, 6, 9, 9]
    # b shares 6 tokens with a: token-level 6 of 16; with 4-token pages 4 of 16.
    assert wl.optimal_hit_rate([a, b]) == pytest.approx(6 / 16)
    assert wl.optimal_hit_rate([a, b], page_size=4) == pytest.approx(4 / 16)
    # An identical repeat reuses all but its last token.
    assert wl.optimal_hit_rate([a, a]) == pytest.approx(7 / 16)
    # Cacheable answers: the second prompt extends the first prompt + its answer.
    c = a + [20, 21, 22]
    assert wl.optimal_hit_rate([a, c], cacheable=[a + [20, 21], c]) == pytest.approx(10 / 19)
    assert wl.optimal_hit_rate([]) == 0.0
    with pytest.raises(ValueError):
        wl.optimal_hit_rate([a], page_size=0)


def test_shared_system_structure_and_optimum() -> None:
    tok = CharTokenizer()
    w = wl.shared_system(tok, seed=1, systems=2, requests=6, system_tokens=300, max_tokens=8)
    assert len(w.requests) == 6 and all(r.max_tokens == 8 for r in w.requests)
    # Brute force: each request reuses its longest common prefix with any earlier one.
    prompts = [r.prompt_ids for r in w.requests]
    hit = sum(
        min(max((wl.common_prefix(p, q) for q in prompts[:i]), default=0), len(p) - 1)
        for i, p in enumerate(prompts)
    )
    assert w.optimal_hit_rate() == pytest.approx(hit / sum(map(len, prompts)))
    # Two system prompts of >= 300 tokens shared by 3 requests each: most tokens reusable.
    assert 0.5 < w.optimal_hit_rate(16) <= w.optimal_hit_rate(1) < 1.0


def test_workloads_are_seeded_and_salted() -> None:
    tok = CharTokenizer()
    for name in wl.WORKLOADS:
        small = {
            "shared_system": {"requests": 4, "system_tokens": 100},
            "multi_turn": {"conversations": 2},
            "few_shot": {"requests": 4, "example_tokens": 40},
        }[name]
        a = wl.build(name, tok, seed=3, salt=5, **small)
        b = wl.build(name, tok, seed=3, salt=5, **small)
        c = wl.build(name, tok, seed=3, salt=6, **small)
        assert [r.prompt_ids for r in a.requests] == [r.prompt_ids for r in b.requests]
        # Another salt: same lengths and optimum, no shared prefix with the first run beyond the template.
        assert [len(r.prompt_ids) for r in a.requests] == [len(r.prompt_ids) for r in c.requests]
        assert a.optimal_hit_rate() == pytest.approx(c.optimal_hit_rate())
        assert (
            max(
                wl.common_prefix(x.prompt_ids, y.prompt_ids) for x in a.requests for y in c.requests
            )
            < 20
        )


def test_multi_turn_history_is_a_prefix() -> None:
    tok = CharTokenizer()
    w = wl.multi_turn(tok, conversations=3, turns=3, answer_tokens=30)
    for session in w.sessions:
        for prev, nxt in zip(session, session[1:]):
            assert nxt.prompt_ids[: len(prev.prompt_ids) - 1] == prev.prompt_ids[:-1]
    # Issue order: every first turn, then every second turn, ...
    assert [len(r.messages) for r in w.requests] == [2] * 3 + [4] * 3 + [6] * 3
