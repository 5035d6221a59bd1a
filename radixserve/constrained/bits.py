"""Token bitmasks, xgrammar's layout: bit ``t % 32`` of int32 word ``t // 32`` set when token
``t`` may come next. Kept free of xgrammar, so that masks that need no grammar (a thinking
budget's forced tokens) cost no grammar import."""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a token bitmask."""
    return (vocab_size + 31) // 32


def all_tokens_but(words: int, tokens: Iterable[int]) -> np.ndarray:
    """An int32 bitmask row of ``words`` words with every bit set except those of ``tokens``."""
    mask = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
    for t in tokens:
        mask[t // 32] &= ~np.uint32(1 << (t % 32))
    return mask.view(np.int32)


@cache
def every_token(words: int) -> torch.Tensor:
    """A ``[1, words]`` int32 bitmask that allows every token: one per vocabulary, shared by
    every request that asks (readers copy masks into their batch, never write them)."""
    return torch.full((1, words), -1, dtype=torch.int32)


def only_token(words: int, token_id: int) -> torch.Tensor:
    """A ``[1, words]`` int32 bitmask that allows ``token_id`` alone."""
    mask = np.zeros(words, dtype=np.uint32)
    mask[token_id // 32] = np.uint32(1 << (token_id % 32))
    return torch.from_numpy(mask.view(np.int32)).view(1, words)


def allows(mask: torch.Tensor, token_id: int) -> bool:
    """Whether bit ``token_id`` of a ``[1, words]`` int32 bitmask is set."""
    return bool((int(mask[0, token_id // 32]) >> (token_id % 32)) & 1)
