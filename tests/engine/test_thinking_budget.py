"""``thinking_token_budget``: a ``<think>`` block closed after that many tokens, on every path.

Checked against transformers' greedy decoding with the closing tokens forced by a reference
written here (on the tiny Llama whose tokenizer has ``<think>`` and ``</think>`` as single
tokens), in batches that mix budgets, unbudgeted rows, a grammar and speculative decoding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models
import torch
from engine_helpers import greedy, hf_greedy, hf_model, random_prompts

from radixserve.constrained.thinking_budget import ThinkingBudget, ThinkMarkers
from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

THINK, END = 512, 513  # build_tiny_reasoner's ids
N = 12


@pytest.fixture(scope="module")
def reasoner_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.build_tiny_reasoner(tmp_path_factory.mktemp("reasoner"))


@pytest.fixture(scope="module")
def engine(reasoner_dir: Path) -> Engine:
    return Engine(str(reasoner_dir), page_size=4, num_pages=512, seed=0)


@pytest.fixture(scope="module")
def close(engine: Engine) -> list[int]:
    """The closing tokens: the tokenizer's newline, then ``</think>``."""
    markers = engine.intake.think_markers
    assert markers is not None and (markers.start, markers.end) == (THINK, END)
    return list(markers.close)


def hf_budgeted(
    model_dir: Path,
    prompt: list[int],
    budget: int,
    close: list[int],
    n: int,
    bias: dict[int, float] | None = None,
) -> list[int]:
    """transformers' greedy decoding (``bias`` added to its logits), the think block closed
    once ``budget`` tokens were written inside blocks."""
    model = hf_model(model_dir)
    markers = [t for t in prompt if t in (THINK, END)]
    inside = bool(markers) and markers[-1] == THINK
    used, pending = 0, list(close) if inside and budget == 0 else []
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            if pending:
                ids.append(pending.pop(0))
                inside = bool(pending)
                continue
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for t, b in (bias or {}).items():
                logits[t] += b
            tok = int(logits.argmax())
            ids.append(tok)
            if inside and tok == END:
                inside = False
            elif inside:
                used += 1
            elif tok == THINK:
                inside = True
            if inside and used >= budget:
                pending = list(close)
    return ids[len(prompt) :]


def test_a_block_opened_in_the_prompt_is_closed_at_the_budget(
    reasoner_dir: Path, engine: Engine, close: list[int]
) -> None:
    """DeepSeek-R1's shape: the template opens the block; counting starts with the output."""
    prompt = [*random_prompts([9], seed=3)[0], THINK]
    budgets = [0, 3, 7]
    outs = engine.generate(
        [prompt] * 4,
        [greedy(N)] + [greedy(N, thinking_token_budget=b) for b in budgets],
    )
    assert outs[0].token_ids == hf_greedy(reasoner_dir, prompt, N)
    for b, out in zip(budgets, outs[1:]):
        assert out.token_ids == hf_budgeted(reasoner_dir, prompt, b, close, N)
        assert out.token_ids[b : b + len(close)] == close  # closed by the budget, not the model
    assert outs[2].token_ids[:3] == outs[0].token_ids[:3]  # untouched within the budget


def test_a_block_the_model_opens_counts_from_there_and_the_budget_is_the_whole_answers(
    reasoner_dir: Path, engine: Engine, close: list[int]
) -> None:
    """A bias makes the model open a block whenever it may: the first gets the budget, every
    later one is closed at once (nothing is left)."""
    prompt = random_prompts([7], seed=4)[0]
    bias = {THINK: 100.0}
    out = engine.generate([prompt], greedy(N, thinking_token_budget=2, logit_bias=bias))[0]
    assert out.token_ids == hf_budgeted(reasoner_dir, prompt, 2, close, N, bias)
    assert out.token_ids[:3] == [THINK, THINK, THINK]  # <think>, then two tokens inside
    assert out.token_ids.count(END) >= 2


def test_without_a_block_the_budget_changes_nothing(reasoner_dir: Path, engine: Engine) -> None:
    prompt = random_prompts([10], seed=5)[0]
    out = engine.generate([prompt], greedy(N, thinking_token_budget=0))[0]
    assert out.token_ids == hf_greedy(reasoner_dir, prompt, N)
    assert THINK not in out.token_ids


def test_speculative_decoding_keeps_the_budget(reasoner_dir: Path, close: list[int]) -> None:
    """The ngram drafter's drafts stop short of the budget: the same tokens as without it.
    In the third row a bias makes the output one token repeated, which the drafter drafts
    far ahead, across the point where the closing must be forced."""
    spec = Engine(
        str(reasoner_dir),
        page_size=4,
        num_pages=512,
        seed=0,
        speculative_algorithm="ngram",
        speculative_num_tokens=4,
    )
    opened = [*random_prompts([9], seed=3)[0], THINK]
    plain = random_prompts([7], seed=4)[0]
    x = 40
    repeated = [*random_prompts([5], seed=7)[0], THINK]
    outs = spec.generate(
        [opened, plain, repeated],
        [
            greedy(2 * N, thinking_token_budget=5),
            greedy(2 * N, thinking_token_budget=2, logit_bias={THINK: 100.0}),
            greedy(2 * N, thinking_token_budget=6, logit_bias={x: 100.0}),
        ],
    )
    assert outs[2].token_ids == hf_budgeted(reasoner_dir, repeated, 6, close, 2 * N, {x: 100.0})
    assert outs[2].token_ids[:9] == [x] * 6 + close + [x]
    assert outs[0].token_ids == hf_budgeted(reasoner_dir, opened, 5, close, 2 * N)
    assert outs[1].token_ids == hf_budgeted(reasoner_dir, plain, 2, close, 2 * N, {THINK: 100.0})
    assert spec.stats().spec_drafted_tokens_total > 0


def test_a_grammar_that_forbids_the_closing_wins(engine: Engine) -> None:
    prompt = [*random_prompts([9], seed=3)[0], THINK]
    regex = greedy(N, regex="[a-z]{6}")
    both = greedy(N, regex="[a-z]{6}", thinking_token_budget=1)
    outs = engine.generate([prompt] * 2, [regex, both])
    assert outs[1].token_ids == outs[0].token_ids and outs[1].finish_reason == "stop"


def test_a_model_without_think_tokens_keeps_any_budget(tiny_llama_dir: Path) -> None:
    """No ``<think>`` in the vocabulary: no block can open, so the budget is kept by itself
    (a Messages API client sends one whatever the model)."""
    engine = Engine(str(tiny_llama_dir), page_size=4, num_pages=128, seed=0)
    assert engine.intake.think_markers is None
    prompt = random_prompts([8], seed=6)[0]
    out = engine.generate([prompt], greedy(6, thinking_token_budget=1))[0]
    assert out.token_ids == hf_greedy(tiny_llama_dir, prompt, 6)


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="thinking_token_budget must be >= 0"):
        SamplingParams(thinking_token_budget=-1).validate()


MARKERS = ThinkMarkers(start=THINK, end=END, close=(201, END))


@pytest.mark.parametrize(
    ("prompt", "accepted", "draft", "expected"),
    [
        ([5, THINK], [], [7, 8, 9, 10], 3),  # rows 0..3 unforced while used + row < 4
        ([5, THINK], [7, 8], [9, 10, 11], 1),
        ([5, THINK], [7, 8, 9], [10], 0),  # the next token is forced: no drafts
        ([5, THINK], [7, 8, 9, 10], [201, END], 0),  # forcing: none
        ([5], [], [7, THINK, 8], 1),  # not past a <think>: counting would start there
        ([THINK, 5, END], [], [7, 8], 2),  # a closed block in the prompt: nothing to count
    ],
)
def test_drafts_stop_short_of_the_budget(
    prompt: list[int], accepted: list[int], draft: list[int], expected: int
) -> None:
    tb = ThinkingBudget(4, MARKERS, 516, prompt)
    assert all(tb.accept(t) for t in accepted)
    assert tb.lookahead(draft) == expected


def test_ignore_eos_keeps_the_end_token_samplable(engine: Engine) -> None:
    """A budget is no grammar: under ``ignore_eos`` the end token may still be drawn (and
    ignored), as without a budget; only a grammar's rows keep it for where nothing else fits."""
    prompt = random_prompts([6], seed=8)[0]
    eos = tiny_models.EOS_TOKEN_ID
    bias = {eos: 100.0}
    outs = engine.generate(
        [prompt] * 2,
        [greedy(4, logit_bias=bias), greedy(4, logit_bias=bias, thinking_token_budget=1)],
    )
    assert outs[0].token_ids == [eos] * 4 and outs[1].token_ids == outs[0].token_ids
