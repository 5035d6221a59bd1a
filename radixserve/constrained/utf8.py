"""Keep constrained output valid UTF-8: no surrogate code points.

xgrammar (0.2.9) matches a grammar's characters on UTF-8 bytes and rejects malformed
sequences, but it lets through the three-byte encodings of the UTF-16 surrogates U+D800 to
U+DFFF (``ED A0 80`` to ``ED BF BF``), which are not UTF-8: a JSON string, a regex's ``.`` or
a negated class then counts such a "character" as one, and the text decodes it as three
U+FFFD, so a ``maxLength: 8`` string comes out ten characters long. Every surrogate encoding,
and nothing else, starts with the byte ``ED`` followed by a byte in ``A0``-``BF``; the
matcher clears from its mask every token that would put that pair in the output:

- tokens whose own bytes hold it, always;
- after a token that ends in ``ED``, tokens that start with ``A0``-``BF``.

Tokens with no bytes (special tokens) leave the last byte as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from radixserve.constrained.bits import all_tokens_but, bitmask_words

_LEAD = 0xED  # the lead byte of U+D000..U+DFFF
_SURROGATE_SECOND = range(0xA0, 0xC0)  # after ED: U+D800..U+DFFF


class SurrogateGuard(NamedTuple):
    """Per-vocabulary masks that keep surrogate encodings out of the output (module doc)."""

    always: np.ndarray  # int32 [words]: tokens that never hold ED A0..BF themselves
    after_lead: np.ndarray  # int32 [words]: tokens that may follow a trailing ED
    ends_in_lead: frozenset[int]  # tokens whose last byte is ED
    no_bytes: frozenset[int]  # tokens that add no bytes

    @classmethod
    def from_vocab(cls, decoded: Sequence[bytes], vocab_size: int) -> SurrogateGuard:
        """From each token id's bytes (``xgr.TokenizerInfo.decoded_vocab``); ids past the
        tokenizer's own vocabulary (logits padding) are never allowed anyway."""
        words = bitmask_words(vocab_size)
        holds, starts, ends, empty = [], [], [], []
        for t, b in enumerate(decoded[:vocab_size]):
            if not b:
                empty.append(t)
                continue
            if any(b[i] == _LEAD and b[i + 1] in _SURROGATE_SECOND for i in range(len(b) - 1)):
                holds.append(t)
            if b[0] in _SURROGATE_SECOND:
                starts.append(t)
            if b[-1] == _LEAD:
                ends.append(t)
        return cls(
            all_tokens_but(words, holds),
            all_tokens_but(words, starts),
            frozenset(ends),
            frozenset(empty),
        )

    def after(self, ends_in_lead: bool, token_id: int) -> bool:
        """Whether the output ends in ``ED`` once ``token_id`` follows (``ends_in_lead``: before)."""
        if token_id in self.no_bytes:
            return ends_in_lead
        return token_id in self.ends_in_lead

    def apply(self, mask: np.ndarray, ends_in_lead: bool) -> None:
        """Clear from ``mask`` (int32 [words], in place) the tokens that may not come next."""
        mask &= self.always
        if ends_in_lead:
            mask &= self.after_lead
