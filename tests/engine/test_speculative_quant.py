"""Speculative decoding with quantized weights (int8, int4; tiny random Llama, bfloat16,
cpu_gemv's kernels): greedy tokens and logprobs identical to the same quantized engine
without speculation, alone and beside a prompt prefilled in chunks on the dense path (the
verify rows on the packed kernel, the chunk on the path its size picks, in one forward)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import logprobs_of, random_prompts, run_to_completion, solo, tokens_of

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import StepOutput
from radixserve.model.quant.apply import set_dense_min_rows
from radixserve.sampling_params import SamplingParams

PROMPTS = [p + p[:12] for p in random_prompts([9, 31], seed=1)]
DENSE_FROM = 4  # rows from which a quantized layer decodes its weight (verify rows: up to 9)


def _params(n: int = 30) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)


def _engine(model: Path, method: str, **kw: object) -> Engine:
    e = Engine(
        str(model),
        dtype="bfloat16",
        quantization=method,
        num_threads=1,
        num_pages=256,
        page_size=4,
        max_num_tokens=16,  # a long prompt goes in chunks of 16 rows: the dense path
        **kw,
    )
    if e.runner.row_invariance_problem() is not None:
        e.close()
        pytest.skip(f"no row-invariant quantized kernels here: {e.runner.row_invariance_problem()}")
    assert set_dense_min_rows(e.model, DENSE_FROM) > 0
    return e


@pytest.fixture(scope="module", params=["int8", "int4"])
def engines(request: pytest.FixtureRequest, tiny_llama_hd64_dir: Path) -> Iterator[list[Engine]]:
    base = _engine(tiny_llama_hd64_dir, request.param)
    spec = _engine(
        tiny_llama_hd64_dir,
        request.param,
        speculative_algorithm="radix",  # a prompt's second run drafts its first run's output
        speculative_num_tokens=8,
    )
    yield [base, spec]
    base.close()
    spec.close()


def test_quantized_greedy_identical_alone_and_beside_a_dense_chunk(
    engines: list[Engine],
) -> None:
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
    # Beside a 70-token prompt prefilled in chunks of up to 16 rows (dense) in the same steps;
    # a's drafts (its solo run's output) stand, so its verify rows (up to 9: past DENSE_FROM)
    # take the packed kernel beside the chunk's dense rows in one forward.
    long_prompt = random_prompts([70], seed=7)[0]
    want_a, want_b = solo(base, PROMPTS[0], _params()), solo(base, long_prompt, _params(8))
    assert spec.flush_cache()
    a = spec.add_request(PROMPTS[0], _params())
    got: dict[str, list[StepOutput]] = {}
    while a not in got:  # a's prefill alone, as in its solo run
        for o in spec.step():
            got.setdefault(o.request_id, []).append(o)
    b = spec.add_request(long_prompt, _params(8))
    for rid, outs in run_to_completion(spec).items():
        got.setdefault(rid, []).extend(outs)
    assert tokens_of(got[a]) == tokens_of(want_a) and logprobs_of(got[a]) == logprobs_of(want_a)
    # (b's chunks are cut otherwise than alone: tokens, as test_speculative's mixed batch.)
    assert tokens_of(got[b]) == tokens_of(want_b)
    usage = got[a][-1].usage
    assert usage is not None and usage.spec_accepted_tokens >= 20
