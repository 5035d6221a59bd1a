"""Where each pair of consecutive tokens occurred in a set of token sequences.

The table both drafters look continuations up in::

    sequence s:   ... a b X Y Z ...          key (a, b) -> (s, position of X)
    context:      ......... a b | ?          propose X Y Z ... (up to k tokens)

A key keeps its ``PER_KEY`` most recent occurrences. Of those, the one whose tokens before
the pair agree longest with the context's (up to ``MAX_MATCH``) wins, the most recent on a
tie: vLLM's n-gram proposer takes the longest n-gram match the same way. Indexing a
sequence costs one dict update per token; a look-up, a few list comparisons.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["KEY", "Match", "NgramTable"]

KEY = 2  # tokens in a key: the shortest match that proposes anything
PER_KEY = 4  # occurrences kept per key
MAX_MATCH = 16  # tokens compared backwards to rank occurrences


class Match(NamedTuple):
    """An occurrence of the context's last ``KEY`` tokens: in which sequence, where its
    continuation starts, and how many tokens before it agree with the context."""

    seq: int
    pos: int
    length: int


class NgramTable:
    """Occurrences of token pairs in sequences known by integer ids."""

    def __init__(self) -> None:
        self._where: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def add(self, seq_id: int, tokens: Sequence[int], start: int, end: int) -> None:
        """Index the pairs of ``tokens`` whose continuation lies at ``start .. end - 1``."""
        where = self._where
        for p in range(max(start, KEY), end):
            key = (tokens[p - 2], tokens[p - 1])
            occ = where.get(key)
            if occ is None:
                where[key] = [(seq_id, p)]
            else:
                occ.append((seq_id, p))
                if len(occ) > PER_KEY:
                    del occ[0]

    def remove(self, seq_id: int, tokens: Sequence[int], end: int) -> None:
        """Forget ``seq_id``'s occurrences (indexed up to ``end``)."""
        where = self._where
        for p in range(KEY, end):
            key = (tokens[p - 2], tokens[p - 1])
            occ = where.get(key)
            if occ is not None:
                occ[:] = [o for o in occ if o[0] != seq_id]
                if not occ:
                    del where[key]

    def best(self, context: Sequence[int], seqs: dict[int, list[int]]) -> Match | None:
        """The occurrence of ``context``'s last pair that agrees longest with it, or None.
        ``seqs``: the tokens of each sequence id still known (others' occurrences are skipped)."""
        ranked = self.ranked(context, seqs)
        return ranked[0] if ranked else None

    def ranked(self, context: Sequence[int], seqs: dict[int, list[int]]) -> list[Match]:
        """Every kept occurrence of ``context``'s last pair, the longest agreement first (the
        most recent first among equals); ``seqs`` as for :meth:`best`."""
        n = len(context)
        if n < KEY:
            return []
        occ = self._where.get((context[-2], context[-1]))
        if not occ:
            return []
        found: list[Match] = []
        for seq_id, pos in reversed(occ):  # most recent first: it wins ties (a stable sort)
            tokens = seqs.get(seq_id)
            if tokens is None:
                continue
            length = KEY
            while (
                length < MAX_MATCH
                and pos - length - 1 >= 0
                and n - length - 1 >= 0
                and tokens[pos - length - 1] == context[n - length - 1]
            ):
                length += 1
            found.append(Match(seq_id, pos, length))
        found.sort(key=lambda m: -m.length)
        return found
