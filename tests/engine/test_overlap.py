"""Overlap scheduling: step N+1 is planned and launched before step N's results are read.

The outputs must be those of the plain loop (greedy; stops found one step late, aborts,
retraction, constrained requests, warm and cold cache), and pages a step in flight may
read are freed only once it has been resolved. On the CPU the launch runs the step at once,
so what these tests exercise is the bookkeeping: placeholders for tokens not read yet, the
next plan naming them by row, late stop checks and the deferred frees.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_helpers import greedy, hf_greedy, random_prompts

from radixserve.sampling_params import SamplingParams


def _run(engine, prompts, params, abort_at: dict[int, str] | None = None):  # type: ignore[no-untyped-def]
    """Staggered arrivals (one per step), aborts at given steps; outputs and finish reasons."""
    queue = list(enumerate(zip(prompts, params)))
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while queue or engine.has_unfinished():
        if queue:
            i, (p, sp) = queue.pop(0)
            engine.add_request(p, sp, request_id=f"r{i}")
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.usage.completion_tokens == len(got[o.request_id])  # no placeholder counted
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        engine.check_invariants()
        step += 1
        assert step < 2000
    s = engine.stats()
    assert s.pages_in_use == 0 and s.running == s.waiting == 0
    return got, reasons


@pytest.mark.parametrize("page_size", [1, 16])
def test_overlap_greedy_identical_with_stops_and_aborts(
    tiny_llama_dir: Path, make_engine, page_size: int
) -> None:
    prompts = random_prompts([6, 13, 4, 9, 11], seed=60)
    prompts.append(prompts[1][:10] + [5])  # warm cache
    ref = [hf_greedy(tiny_llama_dir, p, 9) for p in prompts]
    params = [greedy(9) for _ in prompts]
    params[0] = SamplingParams(
        max_tokens=9, temperature=0.0, ignore_eos=True, stop_token_ids=[ref[0][3]]
    )
    params[3] = SamplingParams(
        max_tokens=9, temperature=0.0, ignore_eos=True, stop_token_ids=[ref[3][0]]
    )
    results = {}
    for mode in ("off", "on"):
        engine = make_engine(
            tiny_llama_dir,
            page_size=page_size,
            num_pages=2048 // page_size,
            overlap_schedule=mode,
            decode_graphs=mode,
        )
        assert engine.loop.overlap == (mode == "on")
        results[mode] = _run(engine, prompts, params, abort_at={5: "r2"})
    # An abort lands between steps: with overlap the token of the step in flight is not out
    # yet, so the aborted output may be one token shorter; it is still a prefix of the greedy one.
    for got_m, _ in results.values():
        assert ref[2][: len(got_m["r2"])] == got_m.pop("r2")
    assert results["on"] == results["off"]
    got, reasons = results["on"]
    assert reasons["r0"] == "stop" and got["r0"] == ref[0][: ref[0].index(ref[0][3]) + 1]
    assert reasons["r3"] == "stop" and got["r3"] == ref[3][:1]
    assert reasons["r2"] == "abort"
    assert got["r5"] == ref[5] and reasons["r5"] == "length"


def test_overlap_with_retraction(tiny_llama_dir: Path, make_engine) -> None:
    prompts = random_prompts([9, 12, 7, 10, 8], seed=61)
    results = {}
    for mode in ("off", "on"):
        engine = make_engine(
            tiny_llama_dir,
            page_size=2,
            num_pages=30,
            overlap_schedule=mode,
            init_new_token_ratio=0.0,
            min_new_token_ratio=0.0,
        )
        results[mode] = _run(engine, prompts, [greedy(8) for _ in prompts])
        assert engine.stats().retractions_total > 0
    assert results["on"] == results["off"]
    assert [results["on"][0][f"r{i}"] for i in range(len(prompts))] == [
        hf_greedy(tiny_llama_dir, p, 8) for p in prompts
    ]


def test_overlap_with_constrained_and_penalized_requests(tiny_llama_dir: Path, make_engine) -> None:
    """Grammar masks and penalties need the previous token on the host: those steps resolve
    first. Outputs match the plain loop, the constrained ones still parse."""
    prompts = random_prompts([7, 10, 5, 8], seed=62)
    schema = json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    params = [
        greedy(8),
        SamplingParams(max_tokens=40, temperature=0.0, json_schema=schema),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_tokens=12, temperature=0.0, regex=r"[0-9]{2,5}"),
    ]
    results = {}
    for mode in ("off", "on"):
        engine = make_engine(tiny_llama_dir, page_size=4, overlap_schedule=mode)
        results[mode] = _run(engine, prompts, params)
    assert results["on"] == results["off"]
    assert results["on"][1]["r1"] == "stop" and results["on"][1]["r3"] == "stop"


def test_pages_of_an_abort_wait_for_the_step_in_flight(tiny_llama_dir: Path, make_engine) -> None:
    engine = make_engine(tiny_llama_dir, page_size=4, overlap_schedule="on")
    rid = engine.add_request(random_prompts([10], seed=63)[0], greedy(20))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.in_flight
    free = engine.allocator.num_free + engine.cache.num_evictable_pages
    engine.abort(rid)
    engine.check_invariants()  # the deferred pages are accounted for
    assert (
        engine.allocator.num_free + engine.cache.num_evictable_pages == free
    )  # not yet: a step may read them
    assert not engine.flush_cache()  # nothing runs or waits, but a step is in flight
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()
    assert engine.stats().pages_in_use == 0
    assert engine.flush_cache() and engine.allocator.num_free == engine.allocator.num_pages
