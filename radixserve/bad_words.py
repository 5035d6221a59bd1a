"""``bad_words`` (vLLM's field): words the output must not contain, banned token by token.

Each word is read as the tokens it encodes to, at the start of a text and, where that is
spelled differently, after a space (``"cat"`` and ``" cat"``: a word in a sentence follows a
space) as vLLM reads them. While a row's last output tokens spell all but the last token of
such a sequence, that last token is masked, so the sequence never completes; a one-token
sequence is masked at every step. Words are bounded (:data:`MAX_WORDS` of
:data:`MAX_WORD_CHARS`): the sampler checks each sequence against every row's tail at every
step.

Torch-free, like :mod:`radixserve.sampling_params`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: At most this many words of at most this many characters (and their sequences' tokens).
MAX_WORDS = 64
MAX_WORD_CHARS = 256
MAX_WORD_TOKENS = 64


def word_errors(
    words: Sequence[str] | None, sequences: Sequence[Sequence[int]] | None
) -> list[str]:
    """Why ``bad_words`` or ``bad_words_token_ids`` are refused (none: they may be banned)."""
    errors = []
    if words is not None:
        if len(words) > MAX_WORDS:
            errors.append(f"bad_words has {len(words)} words, more than {MAX_WORDS}")
        elif any(not w.strip() for w in words):
            errors.append("bad_words must not be blank")
        elif any(len(w) > MAX_WORD_CHARS for w in words):
            errors.append(f"a bad word has more than {MAX_WORD_CHARS} characters")
    if sequences is not None:
        if len(sequences) > 2 * MAX_WORDS:
            errors.append(
                f"bad_words_token_ids has {len(sequences)} sequences, more than {2 * MAX_WORDS}"
            )
        elif any(not 0 < len(s) <= MAX_WORD_TOKENS for s in sequences):
            errors.append(f"bad_words_token_ids sequences must have 1 to {MAX_WORD_TOKENS} tokens")
    return errors


def encode_words(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """The token sequences ``words`` stand for: each word's own, and where a space before it
    spells a different first token in as many tokens, that one too."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [s for s in out if s]


def banned_next(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete one of ``sequences`` after ``output`` (the row's
    output tokens so far, drafts before it included)."""
    banned = []
    for seq in sequences:
        head = len(seq) - 1
        if head == 0 or (
            len(output) >= head and list(output[len(output) - head :]) == list(seq[:head])
        ):
            banned.append(seq[-1])
    return banned
