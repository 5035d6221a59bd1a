"""``logit_bias``: added to the logits before the draw, on every path, for the rows that set it.

Checked against transformers' logits with the same bias added (tiny random Llama), in a
batch that mixes biased, unbiased, sampled and grammar-constrained rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import greedy, hf_greedy, hf_model, random_prompts

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams, to_sampling_params

N = 6


def hf_biased_greedy(
    model_dir: Path, prompt: list[int], bias: dict[int, float], n: int
) -> list[int]:
    """Greedy decoding with ``bias`` added to transformers' logits at every step."""
    model = hf_model(model_dir)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for t, b in bias.items():
                logits[t] += b
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(str(tiny_llama_dir), page_size=4, num_pages=512, seed=0)


def test_bias_matches_transformers_and_leaves_other_rows_alone(
    tiny_llama_dir: Path, engine: Engine
) -> None:
    prompt = random_prompts([11], seed=5)[0]
    ref = hf_greedy(tiny_llama_dir, prompt, N)
    # Moderate biases that move some steps and not others: the order of operations matters.
    bias = {ref[0]: -4.0, ref[1]: -2.0, 7: 1.5}
    expected = hf_biased_greedy(tiny_llama_dir, prompt, bias, N)
    assert expected != ref
    forced = 123
    outs = engine.generate(
        [prompt] * 5,
        [
            greedy(N),  # no bias, batched with the biased rows
            greedy(N, logit_bias=bias),
            greedy(N, logit_bias={ref[0]: -100.0}),
            greedy(N, logit_bias={forced: 100.0}),
            SamplingParams(
                max_tokens=N, temperature=1.0, seed=3, ignore_eos=True, logit_bias={forced: 100.0}
            ),
        ],
    )
    assert outs[0].token_ids == ref
    assert outs[1].token_ids == expected
    assert outs[2].token_ids[0] != ref[0]
    assert outs[3].token_ids == [forced] * N
    assert outs[4].token_ids == [forced] * N
    assert not engine.has_unfinished()
    engine.check_invariants()


def test_bias_under_a_grammar_moves_within_it(engine: Engine) -> None:
    """A constrained row takes the bias too, but the grammar still decides what may follow."""
    choices = ["yes", "no"]
    plain = engine.generate("Answer:", SamplingParams(temperature=0.0, choices=choices))[0]
    assert plain.text in choices
    first = plain.token_ids[0]
    other = engine.generate(
        "Answer:", SamplingParams(temperature=0.0, choices=choices, logit_bias={first: -100.0})
    )[0]
    assert other.text in choices and other.text != plain.text
    outside = engine.tokenizer.encode("zebra", add_special_tokens=False)[0]
    kept = engine.generate(
        "Answer:", SamplingParams(temperature=0.0, choices=choices, logit_bias={outside: 100.0})
    )[0]
    assert kept.text == plain.text


@pytest.mark.parametrize(
    "bias, message",
    [
        ({5: 100.5}, r"in \[-100, 100\]"),
        ({5: float("nan")}, r"in \[-100, 100\]"),
        ({-1: 1.0}, "token ids"),
        ({i: 1.0 for i in range(301)}, "more than 300"),
    ],
)
def test_bad_bias_is_a_clear_error(bias: dict[int, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias).validate()


def test_out_of_vocabulary_and_json_keys() -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        SamplingParams(logit_bias={1000: 1.0}).validate(vocab_size=1000)
    assert to_sampling_params({"logit_bias": {"42": -3}}).logit_bias == {42: -3.0}
    with pytest.raises(ValueError, match="token ids"):
        to_sampling_params({"logit_bias": {"hello": 1.0}})
