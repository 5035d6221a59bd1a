"""``stop_regex``: patterns refused before they cost anything, the output cut where one first
matches (streamed or not), undecided text held back, and a backtracking pattern bounded."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from radixserve import stop_regex
from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.sampling_params import SamplingParams
from radixserve.stop_regex import StopPatterns, StopRegexTimeout, pattern_errors

TEXT = "I have 12 apples, 7 pears. Then 30. Done."


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.mark.parametrize(
    ("patterns", "why"),
    [
        (["["], "is not a valid regular expression"),
        (["x*"], "matches the empty string"),
        ([""], "must be non-empty"),
        (["a" * 1025], "has 1025 characters, more than 1024"),
        (["a"] * 17, "has 17 patterns, more than 16"),
        (["(?:(?:a{1000}){1000}){1000}"], "expands to 1000000000 nodes"),
        (["(?>a{100}){200}"], "expands to 20200 nodes"),
        (["(a)(?(1)b{300}|c{200}){50}"], "expands to 25052 nodes"),
    ],
)
def test_bad_patterns_are_refused_by_name(patterns: list[str], why: str) -> None:
    errors = pattern_errors(patterns)
    assert len(errors) == 1 and why in errors[0]
    with pytest.raises(ValueError, match=re.escape(why)):
        SamplingParams(stop_regex=patterns).validate()


def test_a_repeat_bomb_is_refused_before_it_is_compiled() -> None:
    """``regex`` expands bounded repeats when it compiles: this pattern would take tens of
    gigabytes. It must be refused from its parse alone, fast."""
    compiled_before = stop_regex._compile.cache_info().misses
    began = time.perf_counter()
    assert pattern_errors(["(?:(?:(?:a{1000}){1000}){1000}){1000}"])
    assert time.perf_counter() - began < 1.0
    assert stop_regex._compile.cache_info().misses == compiled_before


def test_stop_strings_are_bounded_too() -> None:
    with pytest.raises(ValueError, match="stop has 129 strings, more than 128"):
        SamplingParams(stop=[str(i) for i in range(129)]).validate()
    with pytest.raises(ValueError, match="a stop string has 1025 characters"):
        SamplingParams(stop=["x" * 1025]).validate()
    SamplingParams(stop=["x" * 1024] * 128, stop_regex=[r"\d+\."] * 16).validate()


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> tuple[str, bool]:
    out = ""
    for i in range(0, len(ids), chunk):
        d = detok.add(ids[i : i + chunk], final=i + chunk >= len(ids))
        out += d.text
        if d.stopped:
            return out, True
    return out, False


@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize("keep", [False, True])
def test_output_ends_where_a_pattern_first_matches(tokenizer, chunk: int, keep: bool) -> None:  # type: ignore[no-untyped-def]
    """Streamed a token at a time or all at once, the text is the whole output's cut at the
    leftmost match (the match kept with ``include_stop_str_in_output``), and the pattern
    that matched is named; a stop string later in the text loses to it."""
    ids = tokenizer.encode(TEXT)
    patterns = [r"Then \d+", r"\d+ pears\."]
    params = SamplingParams(stop=["Done"], stop_regex=patterns, include_stop_str_in_output=keep)
    detok = IncrementalDetokenizer(tokenizer, params)
    out, stopped = _stream(detok, ids, chunk)
    m = re.search(patterns[1], TEXT)
    assert m is not None
    assert stopped and out == detok.text == TEXT[: m.end() if keep else m.start()]
    assert detok.matched_stop == patterns[1]


def test_earliest_of_strings_and_patterns_wins(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["apples"], stop_regex=[r"\."]))
    assert detok.add(ids).text == "I have 12 " and detok.matched_stop == "apples"


def test_text_that_could_still_match_is_held_back(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Streaming never sends text that a later token could make part of a match: ``12`` and
    ``7`` wait until what follows them decides (``\\d+ pears``), then go out."""
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop_regex=[r"\d+ pears"]))
    pieces = [detok.add([t]).text for t in ids]
    sent_before_stop = "".join(pieces)
    assert sent_before_stop == "I have 12 apples, "
    cut_at_12 = len("I have ")
    emitted = 0
    for piece in pieces:  # "12" was held back while it could still start "12 pears"
        if emitted <= cut_at_12 < emitted + len(piece):
            assert piece.startswith("12")
        emitted += len(piece)
    plain = IncrementalDetokenizer(tokenizer, SamplingParams(stop_regex=[r"\d+ plums"]))
    streamed = "".join(plain.add([t]).text for t in ids)
    assert streamed + plain.flush() == TEXT and not plain.stopped


def test_no_match_before_min_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(TEXT)
    first = len(tokenizer.encode("I have 12 apples,"))
    params = SamplingParams(stop_regex=[r"\d+"], min_tokens=first, max_tokens=64)
    detok = IncrementalDetokenizer(tokenizer, params)
    out, stopped = _stream(detok, ids, 1)
    assert stopped and out == "I have 12 apples, "  # "12" came before min_tokens; "7" after


def test_a_backtracking_pattern_fails_within_its_budget(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """``(a|a)*$`` on a run of ``a`` that does not end the text backtracks 2^n ways; the
    request's patterns get :data:`CPU_LIMIT_S` of CPU in all, then it fails."""
    ids = tokenizer.encode("a" * 40 + "!")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop_regex=["(a|a)*$"]))
    began = time.thread_time()
    with pytest.raises(StopRegexTimeout, match="took more than"):
        detok.add(ids, final=True)
    assert time.thread_time() - began < 4 * stop_regex.CPU_LIMIT_S
    spent = StopPatterns(["(a|a)*$"])
    with pytest.raises(StopRegexTimeout):
        spent.first_match("a" * 40 + "!", 0)
    with pytest.raises(StopRegexTimeout):  # the budget is spent: no more matching at all
        spent.first_match("b", 0)
