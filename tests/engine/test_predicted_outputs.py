"""Predicted outputs in the engine (tiny random Llama, head_dim 64, the CPU kernels): a
request's ``prediction`` drafts its output with no speculative algorithm configured, and
the output is the one decoded without it, tokens and logprobs, whether the prediction is
right, edited in the middle, or wrong; its pages all come back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import random_prompts, run_to_completion, solo, tokens_of

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import StepOutput
from radixserve.sampling_params import SamplingParams
from radixserve.speculative.prediction import PredictionDrafter

PROMPT = random_prompts([23], seed=7)[0]
N = 48


def _params(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=2, **kw)  # type: ignore[arg-type]


def _lps(outs: list[StepOutput]) -> list[object]:
    return [lp for o in outs for lp in (o.new_logprobs or [])]


def _usage(outs: list[StepOutput]) -> tuple[int, int]:
    usage = outs[-1].usage
    assert usage is not None
    return usage.spec_drafted_tokens, usage.spec_accepted_tokens


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engines(
    request: pytest.FixtureRequest, tiny_llama_hd64_dir: Path
) -> Iterator[dict[str, Engine]]:
    """An engine that never drafts, and one with predicted outputs and no algorithm."""
    kw = {"dtype": request.param, "num_threads": 1, "num_pages": 256, "page_size": 4}
    made = {
        "plain": Engine(str(tiny_llama_hd64_dir), predicted_outputs="off", **kw),
        "pred": Engine(str(tiny_llama_hd64_dir), speculative_num_tokens=8, **kw),
        "ngram": Engine(
            str(tiny_llama_hd64_dir),
            speculative_algorithm="ngram",
            speculative_num_tokens=8,
            **kw,
        ),
    }
    assert made["plain"].scheduler.speculation is None
    yield made
    for e in made.values():
        e.close()


def _pages_back(engine: Engine) -> None:
    free = engine.allocator.num_free + engine.cache.num_evictable_pages
    assert free == engine.allocator.num_pages
    speculation = engine.scheduler.speculation
    assert speculation is not None and isinstance(speculation.drafter, PredictionDrafter)
    assert speculation.drafter.tracked == 0


def test_a_right_prediction_is_accepted_and_changes_nothing(engines: dict[str, Engine]) -> None:
    want = solo(engines["plain"], PROMPT, _params())
    answer = tokens_of(want)
    got = solo(engines["pred"], PROMPT, _params(prediction=answer))
    assert tokens_of(got) == answer
    assert _lps(got) == _lps(want)
    drafted, accepted = _usage(got)
    # Every draft is the answer's next tokens: all stand, and the answer takes a fraction of
    # the steps (outputs) it takes one token at a time.
    assert accepted == drafted >= N // 2
    assert len(got) <= N // 3
    _pages_back(engines["pred"])


def test_an_edited_prediction_is_found_again_after_the_edit(engines: dict[str, Engine]) -> None:
    # A random model's greedy answer repeats a few tokens; with a frequency penalty it is
    # varied like text, where a pair of tokens says where in the prediction the answer is.
    params = _params(frequency_penalty=1.0)
    want = solo(engines["plain"], PROMPT, params)
    answer = tokens_of(want)
    assert len(set(answer)) > N * 3 // 4
    edit = 16
    # The file before the edit: three tokens the answer does not have, where it has two.
    prediction = answer[:edit] + [answer[edit] + 1, 2, 2] + answer[edit + 2 :]
    got = solo(engines["pred"], PROMPT, _params(frequency_penalty=1.0, prediction=prediction))
    assert tokens_of(got) == answer
    assert _lps(got) == _lps(want)
    drafted, accepted = _usage(got)
    assert drafted > accepted  # the edit's drafts were rejected ...
    assert accepted > edit + 8  # ... and the prediction drafted again after it
    _pages_back(engines["pred"])


def test_a_prediction_comes_before_the_servers_drafter(engines: dict[str, Engine]) -> None:
    """On an engine with an algorithm: the prediction drafts while the answer follows it,
    the n-gram drafter after it is used up; the answer is the plain one either way."""
    params = _params(frequency_penalty=1.0)  # a varied answer: little for n-grams to copy
    want = solo(engines["plain"], PROMPT, params)
    answer = tokens_of(want)
    ngram_alone = solo(engines["ngram"], PROMPT, params)
    assert tokens_of(ngram_alone) == answer
    got = solo(engines["ngram"], PROMPT, _params(frequency_penalty=1.0, prediction=answer[:24]))
    assert tokens_of(got) == answer
    assert _lps(got) == _lps(want)
    # Every token of the prediction after the first (which the prefill computes) was drafted
    # and stood, but for those the verify steps gave as their own next token (1 in 9, k = 8).
    assert _usage(got)[1] >= 23 * 8 // 9 > _usage(ngram_alone)[1]


def test_a_wrong_prediction_changes_nothing(engines: dict[str, Engine]) -> None:
    want = solo(engines["plain"], PROMPT, _params())
    wrong = [t + 1 for t in tokens_of(want)]
    got = solo(engines["pred"], PROMPT, _params(prediction=wrong))
    assert tokens_of(got) == tokens_of(want)
    assert _lps(got) == _lps(want)
    _pages_back(engines["pred"])


def test_only_a_request_with_a_prediction_drafts(engines: dict[str, Engine]) -> None:
    """Beside a request without one, in the same steps, and a sampled one with one."""
    engine = engines["pred"]
    want = solo(engines["plain"], PROMPT, _params())
    answer = tokens_of(want)
    other = random_prompts([11], seed=8)[0]
    other_want = tokens_of(solo(engines["plain"], other, _params()))
    assert engine.flush_cache()
    with_pred = engine.add_request(PROMPT, _params(prediction=answer))
    without = engine.add_request(other, _params())
    sampled = engine.add_request(
        PROMPT,
        SamplingParams(max_tokens=N, temperature=0.8, seed=3, ignore_eos=True, prediction=answer),
    )
    got = run_to_completion(engine)  # the invariants after every step
    assert tokens_of(got[with_pred]) == answer
    assert tokens_of(got[without]) == other_want
    assert _usage(got[without]) == (0, 0)
    assert _usage(got[with_pred])[1] > 0
    assert len(tokens_of(got[sampled])) == N
    _pages_back(engine)


def test_a_prediction_is_checked(engines: dict[str, Engine]) -> None:
    engine = engines["pred"]
    with pytest.raises(ValueError, match="prediction out of the vocabulary"):
        engine.add_request(PROMPT, _params(prediction=[1, 10**6]))
    with pytest.raises(ValueError, match="the prediction has .* tokens, more than"):
        engine.add_request(PROMPT, _params(prediction=[1] * (engine.max_total_len + 1)))
    assert not engine.has_unfinished()


def test_a_sliding_window_model_drafts_from_its_prediction(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Gemma 3's sliding layers on the window pool, which frees the pages a request has
    moved past: a right and an edited prediction give the plain engine's tokens and
    logprobs, the invariants (the window pool's among them) after every step."""
    import tiny_models

    path = tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("gemma3_pred"), "gemma3_text", **tiny_models.GEMMA3_SWA
    )
    kw = {"page_size": 4, "num_pages": 64, "max_num_tokens": 12, "window_kv_ratio": 0.5}
    plain = Engine(str(path), predicted_outputs="off", num_threads=1, **kw)  # type: ignore[arg-type]
    pred = Engine(str(path), num_threads=1, **kw)  # type: ignore[arg-type]
    try:
        assert pred.window_pool is not None
        params = _params(frequency_penalty=1.0)
        prompt = random_prompts([30], seed=1)[0]
        want = solo(plain, prompt, params)
        answer = tokens_of(want)
        for prediction in (answer, answer[:10] + [5, 6, 7] + answer[12:]):
            got = solo(pred, prompt, _params(frequency_penalty=1.0, prediction=prediction))
            assert tokens_of(got) == answer
            assert _lps(got) == _lps(want)
            assert _usage(got)[1] >= N // 3
            _pages_back(pred)
    finally:
        plain.close()
        pred.close()
