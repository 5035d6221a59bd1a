"""Static-buffer decode buckets (CUDA graphs on CUDA): same greedy tokens with them on and off.

On the CPU the static path runs eagerly, which is what makes its padding, bucket choice and
scratch page testable without a GPU: padding rows must never change a real row's output,
and the scratch page is never handed to a request.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import greedy, hf_greedy, random_prompts, run_to_completion, tokens_of

from radixserve.engine.decode_graphs import batch_buckets


def test_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert batch_buckets(200)[-4:] == [128, 160, 192, 200]


def _staggered(
    engine, prompts: list[list[int]], n: int, abort: str | None = None
) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """Arrivals one step apart; optionally abort one request mid-way."""
    queue = list(enumerate(prompts))
    got: dict[str, list[int]] = {}
    step = 0
    while queue or engine.has_unfinished():
        if queue:
            i, p = queue.pop(0)
            engine.add_request(p, greedy(n), request_id=f"r{i}")
        if abort is not None and step == 4:
            engine.abort(abort)
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.check_invariants()
        step += 1
    return got


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_identical_with_static_decode_on_and_off(
    tiny_llama_dir: Path, make_engine, page_size: int
) -> None:
    prompts = random_prompts([5, 11, 3, 17, 8], seed=50)
    prompts.append(prompts[1][:9] + [7, 8])  # a warm-cache hit on the second prompt
    runs = {}
    for mode in ("off", "on"):
        engine = make_engine(
            tiny_llama_dir,
            page_size=page_size,
            num_pages=2048 // page_size,
            decode_graphs=mode,
            max_running_requests=6,
        )
        runs[mode] = _staggered(engine, prompts, 7, abort="r2")
        graphs = engine.runner.decode_graphs
        assert (graphs is not None and graphs.replays > 0) == (mode == "on")
        assert engine.stats().pages_in_use == 0
    assert runs["on"] == runs["off"]
    for i, p in enumerate(prompts):
        if i != 2:
            assert runs["on"][f"r{i}"] == hf_greedy(tiny_llama_dir, p, 7)


def test_static_decode_with_retraction(tiny_llama_dir: Path, make_engine) -> None:
    """A pool small enough to retract: the recomputes are extends, decodes go static."""
    prompts = random_prompts([9, 12, 7, 10], seed=51)
    engine = make_engine(
        tiny_llama_dir,
        page_size=2,
        num_pages=30,
        decode_graphs="on",
        init_new_token_ratio=0.0,
        min_new_token_ratio=0.0,
    )
    ids = [engine.add_request(p, greedy(8)) for p in prompts]
    outs = run_to_completion(engine)
    assert engine.stats().retractions_total > 0 and engine.runner.decode_graphs.replays > 0
    for rid, p in zip(ids, prompts):
        assert tokens_of(outs[rid]) == hf_greedy(tiny_llama_dir, p, 8)


def test_the_scratch_page_is_never_allocated(tiny_llama_dir: Path, make_engine) -> None:
    engine = make_engine(tiny_llama_dir, page_size=4, num_pages=8, decode_graphs="on")
    assert engine.pool.num_pages == 9 and engine.allocator.num_pages == 8
    assert engine.runner.decode_graphs.scratch_page == 8
    assert 8 not in engine.allocator.alloc(8)
