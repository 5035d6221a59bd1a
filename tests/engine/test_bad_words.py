"""``bad_words`` (vLLM's): the output never spells a banned word's tokens.

Checked against transformers' greedy decoding with the same rule applied by hand (the token
that would complete a banned sequence masked), on its own and beside unbanned rows; the
words' encoding (each word, and its spelling after a space); and the bounds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import greedy, hf_greedy, hf_model, random_prompts
from transformers import AutoTokenizer

from radixserve.bad_words import encode_words
from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

N = 8


def hf_banned_greedy(
    model_dir: Path, prompt: list[int], sequences: list[list[int]], n: int
) -> list[int]:
    """Greedy decoding where the token completing one of ``sequences`` is masked."""
    model = hf_model(model_dir)
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for seq in sequences:
                if len(seq) == 1 or out[len(out) - len(seq) + 1 :] == seq[:-1]:
                    logits[seq[-1]] = float("-inf")
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine(str(tiny_llama_dir), page_size=4, num_pages=512, seed=0)


def test_banned_sequences_match_transformers(tiny_llama_dir: Path, engine: Engine) -> None:
    prompt = random_prompts([11], seed=8)[0]
    ref = hf_greedy(tiny_llama_dir, prompt, N)
    sequences = [[ref[1], ref[2]], [ref[4]]]  # a pair the model writes, and one token
    expected = hf_banned_greedy(tiny_llama_dir, prompt, sequences, N)
    assert expected != ref
    plain, banned = engine.generate(
        [prompt, prompt], [greedy(N), greedy(N, bad_words_token_ids=sequences)]
    )
    assert plain.token_ids == ref and banned.token_ids == expected
    engine.check_invariants()


def test_words_are_encoded_plain_and_after_a_space(tiny_llama_dir: Path, engine: Engine) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    sequences = encode_words(tok, ["hello", " world"])
    assert tok.encode("hello", add_special_tokens=False) in sequences
    assert tok.encode("world", add_special_tokens=False) in sequences
    prompt = random_prompts([9], seed=9)[0]
    ref = hf_greedy(tiny_llama_dir, prompt, N)
    word = tok.decode(ref[2:3]).strip()
    if not word:
        pytest.skip("the greedy token is blank")
    (out,) = engine.generate([prompt], greedy(N, bad_words=[word]))
    for seq in encode_words(tok, [word]):
        spans = [out.token_ids[i : i + len(seq)] for i in range(len(out.token_ids))]
        assert seq not in spans


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"bad_words": ["x"] * 65}, "more than 64"),
        ({"bad_words": ["  "]}, "blank"),
        ({"bad_words": ["x" * 257]}, "more than 256 characters"),
        ({"bad_words_token_ids": [[]]}, "1 to 64 tokens"),
        ({"bad_words_token_ids": [[10**9]]}, "bad_words_token_ids"),
        ({"bad_words": ["x"], "allowed_token_ids": [5]}, "cannot be combined"),
        ({"bad_words_token_ids": [[5]], "regex": "a+"}, "cannot be combined"),
    ],
)
def test_bounds(kw: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        SamplingParams(**kw).validate(1000)


def test_a_word_of_too_many_tokens_is_refused_by_name(engine: Engine) -> None:
    """The engine encodes words; one that spells more than 64 tokens is refused (not cut)."""
    prompt = random_prompts([5], seed=10)[0]
    with pytest.raises(ValueError, match="1 to 64 tokens"):
        engine.generate([prompt], greedy(2, bad_words=["日本語🙂" * 40]))
    engine.check_invariants()
    assert engine.stats().pages_in_use == 0
