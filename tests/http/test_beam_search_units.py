"""The beam search of /v1/completions (http/beam_search.py) over a table of next-token
logprobs: the beams kept are the best continuations by cumulative logprob; an
end-of-sequence candidate finishes, and the final ranking applies vLLM's length penalty."""

from __future__ import annotations

import asyncio
import math

import pytest

from radixserve.serving.http.beam_search import Beam, beam_search

EOS = 9


def table(rows: dict[tuple[int, ...], dict[int, float]]):  # type: ignore[no-untyped-def]
    """next_tokens over a table keyed by the output so far (after the prompt [0]); each
    entry's probabilities, best first."""

    async def next_tokens(tokens: list[int]) -> list[tuple[int, float]]:
        probs = rows[tuple(tokens[1:])]
        return sorted(((t, math.log(p)) for t, p in probs.items()), key=lambda x: -x[1])

    return next_tokens


ROWS = {
    (): {1: 0.5, 2: 0.4, EOS: 0.1},
    (1,): {3: 0.3, 4: 0.3, EOS: 0.4},
    (2,): {5: 0.9, 6: 0.1},
    (1, 3): {7: 1.0},
    (1, 4): {7: 1.0},
    (2, 5): {7: 1.0},
    (2, 6): {7: 1.0},
}


def run(width: int, max_tokens: int, eos: list[int], penalty: float = 1.0) -> list[Beam]:
    return asyncio.run(beam_search(table(ROWS), [0], width, max_tokens, eos, penalty))


def outputs(beams: list[Beam]) -> list[tuple[int, ...]]:
    return [tuple(b.tokens[1:]) for b in beams]


def test_the_best_continuations_are_kept_by_cumulative_logprob() -> None:
    beams = run(2, 2, [])  # EOS is an ordinary token here
    # After one token: 1 (0.5) and 2 (0.4). After two: 2,5 (0.36), 1,EOS (0.2).
    assert outputs(beams) == [(2, 5), (1, EOS)]
    assert beams[0].logprob == pytest.approx(math.log(0.4 * 0.9))
    assert not any(b.finished for b in beams)


def test_an_end_of_sequence_candidate_finishes_and_competes_by_its_score() -> None:
    """Finished at once: EOS (0.1, scored over length 1) and 1,EOS (0.2, over 2); live to
    the end: 2,5,7 (0.36) and 1,3,7 (0.15), over length 4 (the prompt's token counts).
    Divided by their lengths the long beams rank first; with no length penalty the raw
    cumulative logprobs do, and 1,EOS comes second."""
    assert outputs(run(2, 3, [EOS], penalty=1.0)) == [(2, 5, 7), (1, 3, 7)]
    flat = run(3, 3, [EOS], penalty=0.0)
    assert outputs(flat) == [(2, 5, 7), (1, EOS), (1, 3, 7)]
    assert [b.finished for b in flat] == [False, True, False]
    assert flat[1].score(1.0) == pytest.approx(math.log(0.2) / 2)


def test_a_search_whose_every_candidate_finishes_stops() -> None:
    rows = {(): {EOS: 1.0}}
    beams = asyncio.run(beam_search(table(rows), [0], 3, 5, [EOS]))
    assert outputs(beams) == [(EOS,)] and beams[0].finished
