"""IncrementalDetokenizer: multi-byte safe, stop strings excluded, held-back text released at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


TEXTS = [
    "Hello, world! How are you today?",
    "Ünïcödé characters, emojis 🙂 and 日本語 must round-trip.",
    "日本語🙂🙂 mixed ascii",
]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]).text for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never a half character
    assert detok.text == text


def test_multibyte_split_across_tokens_waits(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # A byte-level vocabulary this small spells 🙂 with several tokens.
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([t]).text for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]).text == "🙂"


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_stop_string_excluded_and_stops(tokenizer, chunk: int) -> None:  # type: ignore[no-untyped-def]
    text = "one two three four five six"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["four", "nine"]))
    out, stopped = "", False
    for i in range(0, len(ids), chunk):
        d = detok.add(ids[i : i + chunk])
        out += d.text
        if d.stopped:
            stopped = True
            assert d.finish_reason == "stop"
            break
    assert stopped and out == "one two three "
    assert detok.add(ids[-1:]) == ("", True, "stop")


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_kept_stop_string_ends_the_text_and_is_named(tokenizer, chunk: int) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("one two three four five six")
    params = SamplingParams(stop=["nine", "three f", "two"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, params)
    out = ""
    for i in range(0, len(ids), chunk):
        d = detok.add(ids[i : i + chunk])
        out += d.text
        if d.stopped:
            break
    # The earliest match wins whichever stop is listed first, and ends the text with it.
    assert out == detok.text == "one two" and detok.matched_stop == "two"
    plain = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["three f"]))
    assert plain.add(ids).text == "one two " and plain.matched_stop == "three f"
    unmatched = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["nine"]))
    unmatched.add(ids, final=True)
    assert unmatched.matched_stop is None


def test_no_stop_string_before_min_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """As in vLLM and SGLang: a stop string in the first ``min_tokens`` tokens' text does not
    end the request; one that ends after them does."""
    text = "one two one two three"
    ids = tokenizer.encode(text)
    first = len(tokenizer.encode("one two"))
    detok = IncrementalDetokenizer(
        tokenizer, SamplingParams(stop=["two"], min_tokens=first + 1, max_tokens=64)
    )
    out, stopped_at = "", None
    for i, t in enumerate(ids):
        d = detok.add([t])
        out += d.text
        if d.stopped:
            stopped_at = i
            break
    assert stopped_at is not None and stopped_at >= first
    assert out == "one two one "
    unbounded = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["two"]))
    assert "".join(unbounded.add([t]).text for t in ids[:first]) == "one "


def test_possible_stop_prefix_is_held_back_then_released(tokenizer) -> None:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["three!"]))
    out = ""
    for t in tokenizer.encode("one two three"):
        out += detok.add([t]).text
    assert out == "one two "  # "three" could still become "three!"
    assert detok.flush() == "three"


def test_skip_special_tokens_and_prompt_context(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("Hello") + [2]  # <|im_end|>
    d1 = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("Say: "))
    assert d1.add(ids, final=True).text == "Hello"
    d2 = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=False))
    assert d2.add(ids, final=True).text == "Hello<|im_end|>"
