"""Prompt lookup (vLLM's n-gram proposer): drafts copied from the request's own text.

The request's last tokens are looked up in its own prompt and output so far; what followed
their best earlier occurrence (:class:`~radixserve.speculative.ngram_table.NgramTable`) is
proposed. Each request's table grows with its tokens (the new ones indexed at each
proposal), so a step costs a few dict updates, not a scan of the context.
"""

from __future__ import annotations

from radixserve.speculative.drafter import Drafter, DraftSource
from radixserve.speculative.ngram_table import NgramTable

__all__ = ["NgramDrafter"]


class _Own:
    """One request's table over its own tokens, indexed up to ``upto``."""

    def __init__(self) -> None:
        self.table = NgramTable()
        self.upto = 0


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self) -> None:
        self._own: dict[str, _Own] = {}

    def propose(self, req: DraftSource, k: int) -> list[int]:
        tokens = req.token_ids
        own = self._own.get(req.request_id)
        if own is None or own.upto > len(tokens):  # new, or its tokens were cut back
            own = self._own[req.request_id] = _Own()
        # Continuations that exist: positions up to the last token (the context's own last
        # pair, whose continuation is what we are guessing, is never a candidate).
        own.table.add(0, tokens, own.upto, len(tokens))
        own.upto = len(tokens)
        match = own.table.best(tokens, {0: tokens})
        if match is None:
            return []
        return tokens[match.pos : match.pos + k]

    def finished(self, req: DraftSource) -> None:
        self._own.pop(req.request_id, None)

    @property
    def tracked(self) -> int:
        """Requests with a table (tests: none once every request finished)."""
        return len(self._own)
