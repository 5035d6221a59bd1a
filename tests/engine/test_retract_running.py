"""``Engine.retract_running`` (a pause's ``retract``): every running request goes back to
the queue with its tokens, its KV cached in the tree and nothing locked or private; run
again it answers as if never stopped, token for token against transformers, with the plain
and the overlapped step loop. Weights updated while it waits apply to the rest of its
output: its first tokens are the old weights', the rest the new weights' greedy
continuation of them, recomputed from nothing the old weights cached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import greedy, hf_greedy, random_prompts

from radixserve.engine.engine import Engine

N = 10
ENGINE: dict[str, Any] = dict(num_pages=128, page_size=4, num_threads=1, dtype="float32")
PROMPTS = random_prompts([13, 9], seed=7)


def _start(engine: Engine, tokens: int) -> tuple[list[str], dict[str, list[int]]]:
    """Both prompts added and stepped until each has at least ``tokens`` output tokens."""
    rids = [engine.add_request(p, greedy(N)) for p in PROMPTS]
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    while min(len(t) for t in out.values()) < tokens:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return rids, out


def _finish(engine: Engine, out: dict[str, list[int]]) -> None:
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_retracted_requests_hold_nothing_and_answer_as_if_never_stopped(
    llamas: tuple[Path, Path], overlap: str
) -> None:
    a, _ = llamas
    engine = Engine(str(a), overlap_schedule=overlap, **ENGINE)
    rids, out = _start(engine, 3)
    assert engine.retract_running() == 2
    out_now = engine.take_outputs()  # the step that was in flight, read (overlap)
    for o in out_now:
        out[o.request_id] += o.new_token_ids
    assert not engine.has_running()
    s = engine.stats()
    assert (s.running, s.waiting, s.pages_in_use) == (0, 2, 0)
    assert s.retractions_total == 2
    engine.check_invariants()
    _finish(engine, out)
    assert [out[r] for r in rids] == [hf_greedy(a, p, N) for p in PROMPTS]
    engine.check_invariants()


def test_weights_updated_while_retracted_requests_wait_answer_the_rest(
    llamas: tuple[Path, Path],
) -> None:
    a, b = llamas
    engine = Engine(str(a), **ENGINE)
    rids, out = _start(engine, 3)
    with pytest.raises(ValueError, match="requests are running"):
        engine.update_weights_from_disk(str(b))
    engine.retract_running()
    assert engine.stats().pages_evictable > 0  # their KV so far, A's, cached in the tree
    engine.update_weights_from_disk(str(b), weight_version="step-1")
    s = engine.stats()
    assert (s.waiting, s.pages_evictable, s.pages_in_use) == (2, 0, 0)  # A's KV is gone
    _finish(engine, out)
    for rid, prompt in zip(rids, PROMPTS):
        old = hf_greedy(a, prompt, N)
        k = next(i for i, (x, y) in enumerate(zip(out[rid] + [-1], old)) if x != y)
        assert 3 <= k < N or out[rid] == old  # at least the tokens before the update are A's
        assert out[rid][k:] == hf_greedy(b, prompt + out[rid][:k], N - k)
    engine.check_invariants()
