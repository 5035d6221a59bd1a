"""``GrammarMatcher.lookahead`` (speculative decoding's draft check): the masks it keeps are
those a matcher that accepted the drafts would have, it cuts a draft at the first token the
grammar forbids and before a stop token, and it leaves the matcher where it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from radixserve.constrained import Constraint
from radixserve.constrained.grammar import GrammarCompiler

EOS = 2
DIGITS = Constraint("regex", r"abc(d|e)fg[0-9]{2,30}")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[EOS])


def test_masks_along_the_draft_and_state_kept(tokenizer: Any, compiler: GrammarCompiler) -> None:
    ids = tokenizer.encode("abcdfg12345678", add_special_tokens=False)
    m = compiler.new_matcher(DIGITS)
    assert m.accept(ids[0])
    before = m.next_mask.clone()
    assert m.lookahead(ids[1:]) == len(ids) - 1
    assert torch.equal(m.next_mask, before) and m.num_accepted == 1 and not m.can_only_end
    ref = compiler.new_matcher(DIGITS)
    assert ref.accept(ids[0])
    assert torch.equal(m.mask_at(0), ref.next_mask)
    for j, t in enumerate(ids[1:], start=1):
        assert ref.accept(t)
        assert torch.equal(m.mask_at(j), ref.next_mask), j
    # Rolled back: the matcher accepts the same tokens again, and forgets the lookahead.
    assert m.replay(ids[1:]) and torch.equal(m.next_mask, ref.next_mask)
    with pytest.raises(IndexError):
        m.mask_at(1)


def test_cut_at_forbidden_and_stop_tokens(tokenizer: Any, compiler: GrammarCompiler) -> None:
    ids = tokenizer.encode("abcdfg12", add_special_tokens=False)
    x = tokenizer.convert_tokens_to_ids("x")
    m = compiler.new_matcher(DIGITS)
    assert m.lookahead([*ids[:3], x, *ids[3:]]) == 3  # "x" never follows "abc"
    assert m.lookahead([*ids, EOS, ids[-1]]) == len(ids)  # cut before the stop token
    assert m.lookahead([x, *ids]) == 0
    assert m.replay(ids) and m.is_completed
    done = compiler.new_matcher(Constraint("choices", ("yes",)))
    yes = tokenizer.encode("yes", add_special_tokens=False)
    # After a token that completes the grammar with nothing more allowed, the draft ends.
    assert done.lookahead([*yes, *yes]) == len(yes)
