"""Speculative decoding in the engine (tiny random Llama, head_dim 64, the CPU kernels):
greedy output and logprobs identical to decoding without speculation, in float32 and
bfloat16, for both drafters, k up to 8, alone and in mixed batches with chunked prefill;
rejected drafts' pages freed at once (the invariants, pool included, after every step);
stops inside a draft; start-up refusals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import random_prompts, run_to_completion, speculative_mixed_batch, tokens_of

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import StepOutput
from radixserve.sampling_params import SamplingParams
from radixserve.scheduling.plan import ScheduledBatch

PAGES = 256
# Prompts that quote themselves (the n-gram drafter's case); a random model's greedy output
# soon cycles too, which both drafters then copy.
PROMPTS = [p + p[:12] for p in random_prompts([9, 31, 14], seed=1)]


def _params(n: int = 40, **kw: object) -> SamplingParams:
    """Greedy, with the logprobs, top 2 and two named tokens' logprobs of every token (each
    the same from a verify row as from a one-row decode step)."""
    kw.setdefault("logprob_token_ids", [5, 9])
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2, **kw)  # type: ignore[arg-type]


def _engine(model: Path, dtype: str, **kw: object) -> Engine:
    kw.setdefault("num_pages", PAGES)
    kw.setdefault("page_size", 4)
    return Engine(str(model), dtype=dtype, num_threads=1, **kw)


def _solo(engine: Engine, prompt: list[int], params: SamplingParams) -> list[StepOutput]:
    """``prompt`` decoded alone from an empty cache (a cached prompt's last row would be
    computed in a one-row step, on the other kernel than the whole prompt's: the logprobs of
    the first token differ in the last bits, speculation or not)."""
    assert engine.flush_cache()
    rid = engine.add_request(prompt, params)
    return run_to_completion(engine)[rid]


def _lps(outs: list[StepOutput]) -> list[object]:
    return [lp for o in outs for lp in (o.new_logprobs or [])]


def _all_pages_back(engine: Engine) -> None:
    assert (
        engine.allocator.num_free + engine.cache.num_evictable_pages == engine.allocator.num_pages
    )


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engines(
    request: pytest.FixtureRequest, tiny_llama_hd64_dir: Path
) -> Iterator[dict[str, Engine]]:
    """A plain engine and one per drafter (k = 8), of one dtype."""
    dtype = request.param
    made = {"base": _engine(tiny_llama_hd64_dir, dtype)}
    for algo in ("ngram", "radix"):
        made[algo] = _engine(
            tiny_llama_hd64_dir, dtype, speculative_algorithm=algo, speculative_num_tokens=8
        )
    yield made
    for e in made.values():
        e.close()


@pytest.mark.parametrize("algorithm", ["ngram", "radix"])
def test_greedy_tokens_and_logprobs_identical(engines: dict[str, Engine], algorithm: str) -> None:
    base, spec = engines["base"], engines[algorithm]
    params = _params()
    want = [_solo(base, p, params) for p in PROMPTS]
    accepted = 0
    for _ in range(2):  # the second round: the radix drafter has the first round's outputs
        assert spec.flush_cache()  # (the drafter's index is not the cache: it stays)
        rids = [spec.add_request(p, params) for p in PROMPTS]
        got = run_to_completion(spec)  # the invariants, the pool's included, after every step
        for rid, ref in zip(rids, want):
            assert tokens_of(got[rid]) == tokens_of(ref)
            assert _lps(got[rid]) == _lps(ref)
            usage = got[rid][-1].usage
            assert usage is not None and usage.spec_accepted_tokens <= usage.spec_drafted_tokens
            accepted += usage.spec_accepted_tokens
    assert accepted > 0, "nothing was accepted: the test checked no verify row"
    stats = spec.stats()
    assert 0 < stats.spec_accepted_tokens_total <= stats.spec_drafted_tokens_total
    # Fewer steps than tokens: accepted drafts cost no forward of their own.
    assert spec.scheduler.speculation is not None
    assert spec.scheduler.speculation.drafter.base.tracked == 0  # type: ignore[union-attr]
    _all_pages_back(spec)


def test_mixed_batch_with_chunked_prefill_and_sampling(
    engines: dict[str, Engine], tiny_llama_hd64_dir: Path
) -> None:
    """A speculating request keeps its solo output while another prefills in chunks beside
    it and a sampled request (speculating too, by rejection sampling, where its drafts find a
    match) decodes in the same steps."""
    base = engines["base"]
    dtype = base.config.dtype
    assert dtype is not None
    spec = _engine(
        tiny_llama_hd64_dir,
        dtype,
        speculative_algorithm="ngram",
        speculative_num_tokens=6,
        max_num_tokens=16,  # the long prompt goes in chunks beside the verify rows
    )
    try:
        got = speculative_mixed_batch(base, spec, PROMPTS[0], _params)
        usage_a = got["a"][-1].usage
        assert usage_a is not None and usage_a.spec_accepted_tokens > 0
        _all_pages_back(spec)
    finally:
        spec.close()


def test_no_drafting_while_more_requests_than_the_batch_limit(tiny_llama_hd64_dir: Path) -> None:
    """``speculative_disable_by_batch_size`` (vLLM's flag): no request drafts, nor does any
    step take the row-invariant kernels, while more requests than that are running or
    waiting. A request that began under that load never drafts; one that began alone stops
    while the load is over and drafts again once it falls back. Outputs stay whole."""
    spec = _engine(
        tiny_llama_hd64_dir,
        "float32",
        speculative_algorithm="ngram",
        speculative_num_tokens=4,
        speculative_disable_by_batch_size=2,
    )
    sched = spec.scheduler
    plan = sched.schedule
    invariant: list[bool] = []  # each step's: did it name its rows' kernels?

    def schedule() -> ScheduledBatch | None:
        batch = plan()
        invariant.append(batch is not None and batch.plan.row_paths is not None)
        return batch

    sched.schedule = schedule  # type: ignore[method-assign]
    got: dict[str, list[StepOutput]] = {}

    def step() -> tuple[int, int]:
        """One step: the load it was planned under, and the tokens it drafted."""
        load = len(sched.running) + len(sched.waiting)
        before = sched.counters.spec_drafted_tokens
        for o in spec.step():
            got.setdefault(o.request_id, []).append(o)
        spec.check_invariants()
        assert not (load > 2 and any(invariant)), "a step over the limit named its kernels"
        invariant.clear()
        return load, sched.counters.spec_drafted_tokens - before

    try:
        # Three at once: over the limit from their first decode, so never drafting.
        crowd = [spec.add_request(p, _params(n)) for p, n in zip(PROMPTS, [6, 40, 40], strict=True)]
        while spec.has_unfinished():
            assert step()[1] == 0
        # One alone drafts; two more join it (over the limit: it stops), then finish first.
        alone = spec.add_request(PROMPTS[0], _params(60))
        drafted = {"before": 0, "over": 0, "after": 0}
        while drafted["before"] == 0 and len(got.get(alone, [])) < 20:
            drafted["before"] += step()[1]
        joined = [spec.add_request(p, _params(4)) for p in PROMPTS[1:]]
        while spec.has_unfinished():
            load, n = step()
            drafted["over" if load > 2 else "after"] += n
        assert drafted["over"] == 0
        assert drafted["before"] > 0 and drafted["after"] > 0, drafted
        lengths = {**dict(zip(crowd, [6, 40, 40], strict=True)), alone: 60}
        lengths |= dict.fromkeys(joined, 4)
        assert {r: len(tokens_of(got[r])) for r in lengths} == lengths
        _all_pages_back(spec)
    finally:
        spec.close()


def _inside_a_draft(spec: Engine, prompts: list[list[int]]) -> tuple[list[int], int, int]:
    """A prompt, and an output position whose token arrives inside a step's accepted run,
    with tokens after it in the same step, and occurs nowhere earlier in the output. (The
    radix drafter, a prompt's second run: its first run's output is drafted from the start.)"""
    for prompt in prompts:
        seen: list[int] = []
        _solo(spec, prompt, _params(40))
        for o in _solo(spec, prompt, _params(40)):
            ids = o.new_token_ids
            for m in range(len(ids) - 1):
                if ids[m] not in seen + ids[:m]:
                    return prompt, len(seen) + m, ids[m]
            seen += ids
    raise AssertionError("no output token first produced inside a verify run")


def test_stop_token_and_max_tokens_inside_a_draft(engines: dict[str, Engine]) -> None:
    base, spec = engines["base"], engines["radix"]
    prompt, pos, tok = _inside_a_draft(spec, PROMPTS)
    # (max_tokens: a request never drafts past it; its last step is cut to fit.)
    for params in (_params(40, stop_token_ids=[tok]), _params(pos + 1)):
        want = _solo(base, prompt, params)
        got = _solo(spec, prompt, params)
        assert tokens_of(got) == tokens_of(want)
        assert len(tokens_of(got)) == pos + 1
        assert got[-1].finish_reason == want[-1].finish_reason
        _all_pages_back(spec)


def test_stop_string_inside_a_draft(engines: dict[str, Engine]) -> None:
    base, spec = engines["base"], engines["radix"]
    spec.generate([PROMPTS[2]], _params(40))  # its output is drafted from the start next time
    ref = base.generate([PROMPTS[2]], _params(40))[0]
    stop = ref.text[len(ref.text) * 2 // 3 :][:3]
    params = _params(40, stop=[stop], include_stop_str_in_output=True)
    want = base.generate([PROMPTS[2]], params)[0]
    got = spec.generate([PROMPTS[2]], params)[0]
    assert (got.text, got.token_ids, got.finish_reason, got.matched_stop) == (
        want.text,
        want.token_ids,
        want.finish_reason,
        stop,
    )
    assert got.text.endswith(stop)
    assert got.usage.spec_drafted_tokens > 0
    _all_pages_back(spec)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"speculative_algorithm": "eagle"}, "unknown speculative_algorithm"),
        (
            {"speculative_algorithm": "ngram", "speculative_num_tokens": 0},
            "speculative_num_tokens must be in",
        ),
        ({"speculative_algorithm": "ngram", "overlap_schedule": "on"}, "overlap scheduling"),
        (
            {"speculative_algorithm": "ngram", "quantization": "int8", "quant_dense_cache": True},
            "quant_dense_cache",
        ),
        ({"speculative_algorithm": "radix", "disable_radix_cache": True}, "radix cache"),
        ({"speculative_algorithm": "ngram", "pipeline_parallel_size": 2}, "pipeline parallelism"),
    ],
)
def test_unsupported_combinations_refused_at_start(
    options: dict[str, object], message: str
) -> None:
    from radixserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)  # type: ignore[arg-type]
