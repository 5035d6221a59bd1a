"""One request's position in its grammar, and the token mask for its next step.

The matcher keeps the bitmask of the tokens allowed next (bit ``t % 32`` of word
``t // 32`` set when token ``t`` may follow), filled once after every accepted token.
Filling it right away costs nothing extra (the next step needs it anyway) and tells,
before the next forward, whether the grammar can only end here: then the request finishes
at once with "stop" instead of spending a decode step to sample the end-of-sequence token.

The mask also leaves out the tokens that would encode a UTF-16 surrogate, which xgrammar
lets through (:mod:`radixserve.constrained.utf8`).

Retraction keeps a request's tokens, so it keeps its matcher: the recompute re-runs the
model over prompt + output and samples the next token from the same grammar state.

Speculative decoding (:meth:`GrammarMatcher.lookahead`): a draft is walked through the
grammar before it is verified, cut at the first token the mask forbids, and the mask after
each drafted token kept for the verify row that follows it (:meth:`GrammarMatcher.mask_at`);
xgrammar's rollback then puts the matcher back where it was, so the scheduler advances it
through the tokens that stood, one by one, exactly as without speculation::

    matcher at t_last ── d1 ok ── d2 ok ── d3 forbidden: cut      draft = d1 d2
    verify rows:  t_last  d1    d2
    masks:        next    m(d1) m(d1 d2)                          (rolled back: state at t_last)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr

from radixserve.constrained.bits import all_tokens_but, allows, bitmask_words
from radixserve.constrained.spec import CompiledGrammar

#: The most one token may cost the matcher (accepting it and filling the next mask), in CPU
#: seconds of the scheduler's thread, which every request of the worker waits on. A normal
#: grammar takes tens of microseconds; an ambiguous one (``s ::= "a" | s s``) costs more with
#: every token (xgrammar's Earley states multiply, without bound). Past this the request
#: ends with an error instead of stalling the others.
STEP_CPU_LIMIT_S = 0.05


class GrammarMatcher:
    """Accepts a request's sampled tokens and says which tokens may come next.

    ``failure`` says why :meth:`accept` refused a token the grammar allows: following the
    grammar took longer than :data:`STEP_CPU_LIMIT_S` (None otherwise)."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self._m = xgr.GrammarMatcher(compiled.grammar)
        words = bitmask_words(compiled.vocab_size)
        self.next_mask = torch.empty(1, words, dtype=torch.int32)  # filled by _refresh
        # Every bit set except the stop tokens': ANDed with the mask, zero means "only stop may follow".
        self._not_stop = all_tokens_but(
            words, (t for t in compiled.stop_token_ids if 0 <= t < compiled.vocab_size)
        )
        self.num_accepted = 0
        self._can_only_end = False
        self._ends_in_lead = False  # the output's last byte is ED (utf8.SurrogateGuard)
        self._ahead: list[torch.Tensor] = []  # masks after each drafted token (lookahead)
        self.failure: str | None = None
        self._refresh()

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing at all may follow."""
        return bool(self._m.is_terminated())

    @property
    def is_completed(self) -> bool:
        """The text so far is a complete match (more may still follow)."""
        return bool(self._m.is_completed())

    @property
    def can_only_end(self) -> bool:
        """The text so far is complete and no token but a stop token may follow."""
        return self._can_only_end

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token and refresh the next mask. False when the grammar
        does not allow ``token_id`` here (state unchanged), or when following it took too
        long (:attr:`failure` says so; the request is to end)."""
        start = time.thread_time()
        if not self._m.accept_token(int(token_id)):
            return False
        self._ahead = []
        if self.compiled.guard is not None:
            self._ends_in_lead = self.compiled.guard.after(self._ends_in_lead, int(token_id))
        self.num_accepted += 1
        self._refresh()
        return not self._too_slow(time.thread_time() - start)

    def _too_slow(self, spent_s: float) -> bool:
        if spent_s <= STEP_CPU_LIMIT_S:
            return False
        self.failure = (
            f"the {self.compiled.constraint.kind} is too costly to follow: token "
            f"{self.num_accepted} took {1000 * spent_s:.1f} ms of the grammar matcher, more "
            f"than the limit of {1000 * STEP_CPU_LIMIT_S:g} ms (an ambiguous grammar?)"
        )
        return True

    def replay(self, token_ids: Sequence[int]) -> bool:
        """Accept several tokens (a recreated matcher catching up with kept output)."""
        return all(self.accept(t) for t in token_ids)

    def lookahead(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` (speculative decoding) may follow here, one after
        another; the mask after each of them is kept for :meth:`mask_at` until the next
        :meth:`accept`. The matcher's state is left as it was.

        The draft is cut before the first token the mask forbids, before a stop token (no row
        follows a stop: the draft would end the request anyway, and a terminated grammar's
        mask allows nothing), and after a token past which no token at all is allowed."""
        saved = (self.next_mask.clone(), self._can_only_end, self._ends_in_lead)
        stops = self.compiled.stop_token_ids
        masks: list[torch.Tensor] = []
        for t in draft:
            t, start = int(t), time.thread_time()
            if (
                self._can_only_end
                or t in stops
                or not 0 <= t < self.compiled.vocab_size
                or not allows(self.next_mask, t)
                or not self._m.accept_token(t)
            ):
                break
            if self.compiled.guard is not None:
                self._ends_in_lead = self.compiled.guard.after(self._ends_in_lead, t)
            self._refresh()
            masks.append(self.next_mask.clone())
            if not bool(self.next_mask.any()) or time.thread_time() - start > STEP_CPU_LIMIT_S:
                break  # (a costly token is still drafted; the next accept judges it)
        if masks:
            self._m.rollback(len(masks))
        self.next_mask.copy_(saved[0])
        self._can_only_end, self._ends_in_lead = saved[1], saved[2]
        self._ahead = masks
        return len(masks)

    def mask_at(self, j: int) -> torch.Tensor:
        """The ``[1, words]`` mask of the row ``j`` tokens into the last :meth:`lookahead`
        (0: :attr:`next_mask`, the mask after the tokens accepted so far)."""
        return self.next_mask if j == 0 else self._ahead[j - 1]

    def _refresh(self) -> None:
        if self._m.is_terminated():
            self.next_mask.zero_()
            self._can_only_end = True
            return
        self._m.fill_next_token_bitmask(self.next_mask)
        row = self.next_mask.numpy()[0]  # a view: edits land in the mask
        if self.compiled.guard is not None:  # xgrammar admits surrogate encodings (utf8.py)
            self.compiled.guard.apply(row, self._ends_in_lead)
        self._can_only_end = self._m.is_completed() and not np.any(row & self._not_stop)

    def __repr__(self) -> str:
        return (
            f"GrammarMatcher({self.compiled.constraint.describe()}, accepted={self.num_accepted}, "
            f"can_only_end={self._can_only_end})"
        )
