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
    ]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad).validate()  # type: ignore[arg-type]


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
