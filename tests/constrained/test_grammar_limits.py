"""Grammar limits: a pathological regex gets a clear error (before compiling, from its
size; or from the compile-time limit), never a stalled worker."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from radixserve.constrained import Constraint
from radixserve.constrained.grammar import GrammarCompiler
from radixserve.constrained.spec import MAX_REGEX_EXPANSION, regex_expansion
from radixserve.sampling_params import SamplingParams
from radixserve.serving.wire import protocol as p


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def test_regex_expansion_counts_bounded_repetitions() -> None:
    assert regex_expansion(r"\d{3}-\d{4}") == 8
    assert regex_expansion("(.{1,100}){1,100}") == 10_000
    assert regex_expansion("(ab|cd)*x+") == 5  # a loop counts its body once: 2 + 2 + 1
    assert regex_expansion("((a{1,50}){1,50}){1,50}") == MAX_REGEX_EXPANSION + 1  # capped
    assert regex_expansion("[") is None  # unreadable: the grammar library explains


def test_pathological_regex_refused_before_compiling() -> None:
    with pytest.raises(ValueError, match="regex is too complex to compile"):
        SamplingParams(regex="(.{1,1000}){1,1000}").validate()
    with pytest.raises(ValueError, match="more than the limit of"):
        SamplingParams(choices=["x" * 70_000]).validate()
    SamplingParams(regex="[a-z]{1,200}@[a-z]{1,50}\\.com").validate()
    # Over the wire it is a request error naming the reason, decided by the router's decode.
    frame = p.encode(
        p.GenerateRequest(
            request_id="r", text="hi", params=SamplingParams(regex="((a{1,99}){1,99}){9}")
        )
    )
    err = p.decode_client(frame)
    assert (
        isinstance(err, p.Error) and err.code == "invalid_params" and "too complex" in err.message
    )


def test_compile_time_limit(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = GrammarCompiler(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[2], compile_timeout_s=0.2
    )
    release = threading.Event()
    real = compiler._compile

    def slow(c: Constraint) -> Any:  # stands in for a grammar that compiles for minutes
        if c.value == "slow":
            release.wait(30)
        return real(c)

    monkeypatch.setattr(compiler, "_compile", slow)
    t0 = time.monotonic()
    with pytest.raises(
        ValueError, match="too complex: compiling it took longer than the limit of 0.2 s"
    ):
        compiler.compile(Constraint("regex", "slow"))
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()  # asked again: refused at once, not compiled a second time
    with pytest.raises(ValueError, match="longer than the limit"):
        compiler.compile(Constraint("regex", "slow"))
    assert time.monotonic() - t0 < 0.2
    release.set()
    assert (
        compiler.compile(Constraint("regex", "[0-9]+")).constraint.value == "[0-9]+"
    )  # others compile as ever
    with pytest.raises(
        ValueError, match="invalid regex"
    ):  # the library's own errors still come through
        compiler.compile(Constraint("regex", "(unclosed"))


def test_a_grammar_too_costly_to_follow_ends_its_request_only(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ambiguous grammar (``s ::= "a" | s s``) costs the matcher more with every token:
    past the per-token limit its request ends with an error saying so, while a request beside
    it, constrained or not, finishes as it would alone, and no page is lost."""
    from constrained_cases import make_tiny_engine

    from radixserve.constrained import matcher

    engine = make_tiny_engine(tiny_llama_dir)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    regex = SamplingParams(max_tokens=24, temperature=0.0, regex="[0-9]{1,20}")
    alone = engine.generate([[5, 6, 7], [8, 9]], [plain, regex])
    monkeypatch.setattr(matcher, "STEP_CPU_LIMIT_S", 0.0005)  # reached within a few hundred tokens
    ambiguous = SamplingParams(
        max_tokens=400, temperature=0.0, ignore_eos=True, ebnf='root ::= s\ns ::= "a" | s s'
    )
    costly, *others = engine.generate([[1, 2, 3], [5, 6, 7], [8, 9]], [ambiguous, plain, regex])
    assert costly.finish_reason == "error" and "too costly to follow" in (costly.error or "")
    assert 0 < len(costly.token_ids) < 400
    assert [(o.token_ids, o.finish_reason) for o in others] == [
        (o.token_ids, o.finish_reason) for o in alone
    ]
    engine.check_invariants()
    assert engine.stats().pages_in_use == 0
