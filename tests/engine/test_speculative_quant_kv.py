"""Speculative decoding over int8, int4 and fp8 KV pages (tiny random Llama, head size 64, bfloat16):
the native CPU kernel reads those pages with a decode row's bits in every row, so verify
rows give the logits one-row decode steps give. Greedy tokens and logprobs equal the same
quantized-KV engine's without speculation, alone and beside a prompt prefilled in chunks in
the same forwards; every page comes back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import logprobs_of, random_prompts, run_to_completion, solo, tokens_of

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import StepOutput
from radixserve.sampling_params import SamplingParams

PROMPTS = [p + p[:12] for p in random_prompts([9, 31], seed=3)]


def _params(n: int = 30) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)


def _engine(model: Path, kv_dtype: str, **kw: object) -> Engine:
    return Engine(
        str(model),
        dtype="bfloat16",
        kv_cache_dtype=kv_dtype,
        num_threads=1,
        num_pages=256,
        page_size=4,
        max_num_tokens=32,  # a long prompt goes in chunks of 32 rows beside the verify rows
        **kw,
    )


@pytest.fixture(scope="module", params=["int8", "int4", "fp8_e4m3"])
def engines(request: pytest.FixtureRequest, tiny_llama_hd64_dir: Path) -> Iterator[list[Engine]]:
    base = _engine(tiny_llama_hd64_dir, request.param)
    problem = base.runner.row_invariance_problem()
    if problem is not None:
        base.close()
        pytest.skip(f"no row-invariant path here: {problem}")
    spec = _engine(
        tiny_llama_hd64_dir,
        request.param,
        speculative_algorithm="radix",  # a prompt's second run drafts its first run's output
        speculative_num_tokens=8,
    )
    yield [base, spec]
    base.close()
    spec.close()


def test_greedy_identical_alone(engines: list[Engine]) -> None:
    base, spec = engines
    accepted = 0
    for prompt in PROMPTS + PROMPTS:  # the second round drafts the first round's outputs
        want, got = solo(base, prompt, _params()), solo(spec, prompt, _params())
        assert tokens_of(got) == tokens_of(want)
        assert logprobs_of(got) == logprobs_of(want)
        usage = got[-1].usage
        assert usage is not None
        accepted += usage.spec_accepted_tokens
    assert accepted > 0, "no draft stood"
    spec.check_invariants()
    assert spec.allocator.num_free + spec.cache.num_evictable_pages == spec.allocator.num_pages


def test_greedy_identical_beside_a_chunked_prefill(engines: list[Engine]) -> None:
    base, spec = engines
    long_prompt = random_prompts([90], seed=8)[0]
    want_a, want_b = solo(base, PROMPTS[0], _params()), solo(base, long_prompt, _params(8))
    solo(spec, PROMPTS[0], _params())  # its output is in the tree: the next run drafts it
    a = spec.add_request(PROMPTS[0], _params())
    got: dict[str, list[StepOutput]] = {}
    while a not in got:  # a's prefill alone, as in its solo run
        for o in spec.step():
            got.setdefault(o.request_id, []).append(o)
    b = spec.add_request(long_prompt, _params(8))  # prefilled in chunks beside a's verify rows
    for rid, outs in run_to_completion(spec).items():
        got.setdefault(rid, []).extend(outs)
    assert tokens_of(got[a]) == tokens_of(want_a) and logprobs_of(got[a]) == logprobs_of(want_a)
    # (b's chunks are cut otherwise than alone: its tokens, as test_speculative's mixed batch.)
    assert tokens_of(got[b]) == tokens_of(want_b)
    usage = got[a][-1].usage
    assert usage is not None and usage.spec_accepted_tokens > 0
    spec.check_invariants()
    assert spec.allocator.num_free + spec.cache.num_evictable_pages == spec.allocator.num_pages
