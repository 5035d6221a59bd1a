"""``thinking_token_budget``: a ``<think>`` block closed after that many tokens, on every path.

Checked against transformers' greedy decoding with the closing tokens forced by a reference
written here (on the tiny Llama whose tokenizer has ``<think>`` and ``</think>`` as single
tokens), in batches that mix budgets, unbudgeted rows, a grammar and speculative decoding.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from pathlib import Path

import pytest
import tiny_models
import torch
from engine_helpers import greedy, hf_greedy, hf_model, random_prompts

from radixserve.constrained.bits import allows
from radixserve.constrained.thinking_budget import MAX_CHARACTER_WAIT, ThinkingBudget, ThinkMarkers
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


def _mid_character(data: bytes) -> bool:
    """Whether Python's incremental UTF-8 decoder holds back an unfinished character."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(data)
    return bool(decoder.getstate()[0])


def hf_budgeted(
    model_dir: Path,
    prompt: list[int],
    budget: int,
    close: list[int],
    n: int,
    bias: dict[int, float] | None = None,
    token_bytes: Callable[[int], bytes] | None = None,
) -> list[int]:
    """transformers' greedy decoding (``bias`` added to its logits), the think block closed
    once ``budget`` tokens were written inside blocks; with ``token_bytes``, not before the
    block's text ends a character, or MAX_CHARACTER_WAIT tokens later."""
    model = hf_model(model_dir)
    markers = [t for t in prompt if t in (THINK, END)]
    inside = bool(markers) and markers[-1] == THINK
    used, pending = 0, list(close) if inside and budget == 0 else []
    block, waited = b"", 0  # the block's bytes so far; tokens waited past the budget
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
                waited += used >= budget
                used += 1
                block += token_bytes(tok) if token_bytes is not None else b""
            elif tok == THINK:
                inside, block, waited = True, b"", 0
            if inside and used >= budget:
                if not (waited < MAX_CHARACTER_WAIT and _mid_character(block)):
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


def test_a_budget_spent_mid_character_lets_the_character_end(
    reasoner_dir: Path, engine: Engine, close: list[int]
) -> None:
    """The tiny model writes bytes of characters (its byte-level vocabulary), often cut. A
    budget spent right after a character's first byte leaves the block open until the
    character is whole or malformed: one token in the first two rows; in the third the model
    starts a new character with every token, and the block is closed after the most
    tokens waited. Each row against transformers, with the wait judged by Python's decoder."""
    token_bytes = engine.intake.token_bytes
    assert token_bytes is not None
    # (prompt seed, budget: the tokens up to a character's first byte, tokens waited)
    cases = [(5, 4, 1), (2, 6, 1), (7, 4, MAX_CHARACTER_WAIT)]
    prompts = [[*random_prompts([9], seed=seed)[0], THINK] for seed, _, _ in cases]
    plain = engine.generate(prompts, [greedy(2 * N)] * len(cases))
    for (_, budget, _), out in zip(cases, plain):  # the cut lands inside a character
        assert _mid_character(b"".join(token_bytes(t) for t in out.token_ids[:budget]))
    outs = engine.generate(prompts, [greedy(2 * N, thinking_token_budget=b) for _, b, _ in cases])
    for prompt, (_, budget, waited), out, free in zip(prompts, cases, outs, plain):
        want = hf_budgeted(reasoner_dir, prompt, budget, close, 2 * N, token_bytes=token_bytes)
        assert out.token_ids == want
        closed_at = budget + waited
        assert out.token_ids[:closed_at] == free.token_ids[:closed_at]
        assert out.token_ids[closed_at : closed_at + len(close)] == close


_BYTES = {
    20: b"a",
    21: "世".encode()[:1],
    22: "世".encode()[1:2],
    23: "世".encode()[2:],
    24: b"\xe4",
}


def test_the_wait_for_a_character_is_unforced_undrafted_and_bounded() -> None:
    """Unit cases on a byte map: the block closes at a character's end, not inside it;
    drafts wait with it; a character that never ends is cut after MAX_CHARACTER_WAIT."""
    tb = ThinkingBudget(2, MARKERS, 516, [5, THINK], token_bytes=_BYTES.__getitem__)
    assert tb.accept(20) and tb.accept(21)  # budget spent on a character's first byte
    assert allows(tb.next_mask, 300) and tb.lookahead([22, 23]) == 0
    assert tb.accept(22) and allows(tb.next_mask, 300)  # one byte to go
    assert tb.accept(23)  # whole: the closing is forced now
    assert tb.lookahead([201]) == 0 and not allows(tb.next_mask, 300)
    assert allows(tb.next_mask, 201) and tb.used == 4

    cut = ThinkingBudget(1, MARKERS, 516, [5, THINK], token_bytes=_BYTES.__getitem__)
    for _ in range(MAX_CHARACTER_WAIT):
        assert cut.accept(24) and allows(cut.next_mask, 300)  # each one starts a character
    assert cut.accept(24) and not allows(cut.next_mask, 300)  # waited enough: forced

    plain = ThinkingBudget(1, MARKERS, 516, [5, THINK])  # no bytes known: cut at once
    assert plain.accept(24) and not allows(plain.next_mask, 300)


def test_each_models_think_markup_is_found(tiny_llama_dir: Path) -> None:
    """Magistral's ``[THINK]`` and Kimi's ``◁think▷`` blocks are budgeted as ``<think>`` is:
    the first pair of markers the vocabulary holds as single tokens is the model's."""
    from transformers import AutoTokenizer

    from radixserve.constrained.thinking_budget import think_markers

    newline = AutoTokenizer.from_pretrained(str(tiny_llama_dir)).encode(
        "\n", add_special_tokens=False
    )
    for start, end in [("[THINK]", "[/THINK]"), ("\u25c1think\u25b7", "\u25c1/think\u25b7")]:
        tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
        assert think_markers(tok) is None
        tok.add_special_tokens({"additional_special_tokens": [start, end]})
        ids = [tok.convert_tokens_to_ids(t) for t in (start, end)]
        markers = think_markers(tok)
        assert markers is not None and (markers.start, markers.end) == tuple(ids)
        assert markers.close == (*newline, ids[1])
    both = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    both.add_special_tokens(
        {"additional_special_tokens": ["[THINK]", "[/THINK]", "<think>", "</think>"]}
    )
    found = think_markers(both)
    assert found is not None and found.start == both.convert_tokens_to_ids("<think>")
