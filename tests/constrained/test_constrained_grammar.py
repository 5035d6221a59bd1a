"""The grammar layer on its own: parameter checks, compilation and its cache, the matcher's
mask and end detection, and the batched mask on a step's logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from radixserve.constrained import Constraint
from radixserve.constrained.grammar import GrammarCompiler
from radixserve.constrained.mask import apply_token_masks
from radixserve.constrained.matcher import GrammarMatcher
from radixserve.constrained.spec import structural_tag_text
from radixserve.sampling_params import SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    # A logits width above the tokenizer's size: padding ids must never be allowed.
    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer) + 7, stop_token_ids=[EOS])


def allowed_ids(m: GrammarMatcher) -> set[int]:
    bits = np.unpackbits(m.next_mask.numpy().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[: m.compiled.vocab_size]).tolist())


def feed(m: GrammarMatcher, tokenizer: Any, text: str) -> None:
    for t in tokenizer.encode(text, add_special_tokens=False):
        assert m.accept(t), (text, t)


def test_sampling_params_check_constraints_without_a_grammar_library() -> None:
    ok = SamplingParams(json_schema=json.dumps({"type": "object"})).validate()
    assert ok.constraint == Constraint("json_schema", '{"type": "object"}')
    assert SamplingParams(choices=["a", "b"]).validate().constraint == Constraint(
        "choices", ("a", "b")
    )
    assert SamplingParams().validate().constraint is None
    wire = msgspec.msgpack.encode(SamplingParams(regex="[0-9]+"))
    assert msgspec.msgpack.decode(wire, type=SamplingParams).regex == "[0-9]+"
    for bad, msg in [
        (dict(regex="a", json_schema="{}"), "at most one"),
        (dict(regex=""), "non-empty"),
        (dict(json_schema='"str"'), "JSON object"),
        (dict(choices=["a", ""]), "non-empty strings"),
        (dict(ebnf=" \n"), "non-empty grammar"),
        (dict(ebnf="root ::= " + '"a" ' * 20_000), "more than the limit"),
        (dict(ebnf='root ::= "a"', choices=["a"]), "got choices, ebnf"),
    ]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad).validate()  # type: ignore[arg-type]


def test_both_forms_of_a_structural_tag_compile_to_one_grammar() -> None:
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    begin, end = "<function=get_weather>", "</function>"
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": begin, "schema": schema, "end": end}],
        "triggers": ["<function="],
    }
    text = structural_tag_text(json.dumps(legacy))  # as SGLang's /generate sends it: text
    assert structural_tag_text(json.loads(text)) == text  # the current form passes as is
    items = [xgr.StructuralTagItem(begin=begin, schema=json.dumps(schema), end=end)]
    assert str(xgr.Grammar.from_structural_tag(text)) == str(
        xgr.Grammar.from_structural_tag(items, ["<function="])  # xgrammar's own reading
    )
    for bad, msg in [
        ("{", "not valid JSON"),
        ([1], "JSON object"),
        ({"structures": [], "triggers": []}, '"structures" and "triggers"'),
        ({"structures": [{"begin": 1, "end": ""}], "triggers": ["<"]}, '"begin" and "end"'),
    ]:
        with pytest.raises(ValueError, match=msg):
            structural_tag_text(bad)


def test_cache_hits_and_clear_errors(compiler: GrammarCompiler) -> None:
    c = Constraint("regex", "[ab]{3}")
    before = compiler.stats()
    first = compiler.compile(c)
    assert compiler.compile(Constraint("regex", "[ab]{3}")) is first
    after = compiler.stats()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    with pytest.raises(ValueError, match=r"invalid regex: .*parenthesis.*\(regex '\(ab'\)"):
        compiler.compile(Constraint("regex", "(ab"))
    with pytest.raises(ValueError, match=r"invalid json_schema: .*Unsupported type"):
        compiler.compile(Constraint("json_schema", '{"type": "tuple"}'))
    with pytest.raises(ValueError, match=r"invalid ebnf: .*lexer error"):
        compiler.compile(Constraint("ebnf", "::= x"))


def test_mask_is_exactly_the_tokens_that_keep_a_choice_reachable(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    choices = ("yes", "no", "maybe not")
    m = compiler.new_matcher(Constraint("choices", choices))
    allowed = allowed_ids(m)
    vocab = tokenizer.get_vocab()
    for tok_id in range(len(tokenizer)):
        text = tokenizer.decode([tok_id])
        prefix_ok = tok_id not in tokenizer.all_special_ids and any(
            c.startswith(text) for c in choices
        )
        if tok_id in allowed:
            assert prefix_ok, (tok_id, text)
    assert max(allowed) < len(vocab) and EOS not in allowed
    feed(m, tokenizer, "no")
    assert m.can_only_end and allowed_ids(m) == {EOS}
    feed_m = compiler.new_matcher(Constraint("choices", choices))
    feed(feed_m, tokenizer, "maybe")
    assert not feed_m.can_only_end and not feed_m.is_completed


def test_end_only_where_the_grammar_may_end(compiler: GrammarCompiler, tokenizer: Any) -> None:
    m = compiler.new_matcher(Constraint("regex", "[0-9]{1,3}"))
    assert EOS not in allowed_ids(m)
    feed(m, tokenizer, "4")
    assert m.is_completed and EOS in allowed_ids(m) and not m.can_only_end
    feed(m, tokenizer, "2")
    assert not m.can_only_end
    feed(m, tokenizer, "7")
    assert m.can_only_end and allowed_ids(m) == {EOS}
    assert not m.accept(
        tokenizer.encode("1", add_special_tokens=False)[0]
    )  # refused, state unchanged
    assert m.accept(EOS) and m.is_terminated and allowed_ids(m) == set()


def test_length_limited_json_strings_reject_raw_control_characters(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"s": {"type": "string", "maxLength": 4}},
            "required": ["s"],
        }
    )
    m = compiler.new_matcher(Constraint("json_schema", schema))
    feed(m, tokenizer, '{"s": "a')
    ctrl = [t for t in range(len(tokenizer)) if any(ord(ch) < 0x20 for ch in tokenizer.decode([t]))]
    assert ctrl and not (set(ctrl) & allowed_ids(m))
    feed(m, tokenizer, 'b c"}')
    assert m.can_only_end


def test_masks_touch_only_the_constrained_rows(compiler: GrammarCompiler, tokenizer: Any) -> None:
    vocab = compiler.vocab_size
    logits = torch.randn(4, vocab)
    before = logits.clone()
    a = compiler.new_matcher(Constraint("regex", "[0-9]+"))
    b = compiler.new_matcher(Constraint("choices", ("yes", "no")))
    apply_token_masks(logits, [1, 3], [a, b])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row, m in ((1, a), (3, b)):
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == allowed_ids(m)
        assert torch.equal(logits[row][list(finite)], before[row][list(finite)])


def _byte_token(compiler: GrammarCompiler, byte: int) -> int:
    """The byte-level BPE token of one byte (the tiny tokenizer has all 256)."""
    return int(compiler.tokenizer_info.decoded_vocab.index(bytes([byte])))


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json_schema", json.dumps({"type": "string", "maxLength": 8})),
        Constraint("json_schema", json.dumps({"type": "string"})),
        Constraint("regex", "a.b"),
    ],
    ids=["bounded-string", "string", "regex-dot"],
)
def test_no_surrogate_code_point_can_be_sampled(
    compiler: GrammarCompiler, tokenizer: Any, constraint: Constraint
) -> None:
    """xgrammar accepts ED A0 80 (U+D800, not UTF-8) as a character; after a token ending in
    ED the mask keeps the continuations of U+D000-U+D7FF and drops those of the surrogates,
    so the text never decodes to U+FFFD (a maxLength: 8 string came out 10 long)."""
    m = compiler.new_matcher(constraint)
    feed(m, tokenizer, '"a' if constraint.kind == "json_schema" else "a")
    ed, a0, bf, x9f = (_byte_token(compiler, b) for b in (0xED, 0xA0, 0xBF, 0x9F))
    assert ed in allowed_ids(m)
    assert m.accept(ed)
    allowed = allowed_ids(m)
    assert x9f in allowed  # ED 9F .. = U+D7C0-U+D7FF: real characters
    assert a0 not in allowed and bf not in allowed
    # Without the guard xgrammar itself would take it: the mask is what keeps it out.
    assert m._m.accept_token(a0)


def test_surrogate_guard_masks_tokens_that_hold_the_pair() -> None:
    from radixserve.constrained.utf8 import SurrogateGuard

    vocab = [b"", b"ab", b"x\xed\xa0", b"\xed", b"\xa5q", b"\x9f", b"\xed\x9f"]
    g = SurrogateGuard.from_vocab(vocab, vocab_size=40)
    bits = lambda w: set(np.flatnonzero(np.unpackbits(w.view(np.uint8), bitorder="little")))  # noqa: E731
    assert 2 not in bits(g.always) and {0, 1, 3, 4, 5, 6} <= bits(g.always)
    assert 4 not in bits(g.after_lead) and {0, 1, 2, 3, 5, 6} <= bits(g.after_lead)
    assert g.after(False, 3) and not g.after(True, 1) and g.after(True, 0)  # no bytes: unchanged
    mask = np.full(2, -1, dtype=np.int32)
    g.apply(mask, ends_in_lead=True)
    assert 2 not in bits(mask) and 4 not in bits(mask) and 5 in bits(mask)
