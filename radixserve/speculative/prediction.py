"""Predicted outputs (OpenAI's ``prediction``): drafts from the text the client expects back.

A coding agent that asks for a file with a few lines changed knows most of the answer
already: the file as it was. It sends that as the request's prediction, and the answer is
decoded by verifying the prediction's tokens instead of guessing them one step at a time.
Where the answer follows the prediction, each verify step accepts up to ``k`` tokens; where
it departs (the edited lines), the prediction drafts nothing until the answer's last tokens
are found in it again (``MIN_MATCH`` of them agreeing), and goes on from there::

    prediction:  def f(x):⏎    return x + 1⏎⏎def g(y):⏎    return y⏎
    answer:      def f(x):⏎    return x + 2⏎⏎def g(y):⏎    return y⏎
                 ^^^^^^^^^^^^^^^^^^^^^^^^ ^ ^^^^^^^^^^^ ^^^^^^^^^^^^^^^
                 drafted, accepted        | off          found again after "⏎def g(y", then
                                          rejected       drafted from ":⏎" on

:class:`PredictionDrafter` wraps the server's drafter, if any: a request without a
prediction drafts as the server's algorithm would, and so does one whose answer is off its
prediction; with no algorithm, that one drafts by prompt lookup over its own text (the
prompt of an edit holds the code too, and the answer repeats its own lines). The scheduler
verifies a prediction's drafts like any other, so the output is the one decoded without it
(exactly, greedy; in distribution, sampled).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

from radixserve.speculative.drafter import Drafter, DraftSource
from radixserve.speculative.ngram import NgramDrafter
from radixserve.speculative.ngram_table import KEY

__all__ = ["PredictionDrafter", "PredictionTrack"]

# Tokens compared backwards to rank the places the answer may have rejoined: past this many
# agreeing tokens two places are as likely, and the one after the edit wins.
MAX_MATCH = 8
# Tokens that must agree for the answer to rejoin the prediction there (or all of the
# prediction before the place): a few recur too often in code, and a wrong place costs a
# verify, its rows, and the request's adaptive k (replayed over bench_predicted_outputs'
# answers, 3 or 4 drafted less than prompt lookup alone, 5 to 8 the same).
MIN_MATCH = 5
MAX_CANDIDATES = 64  # places looked at per realignment: a pair common in code ("⏎ ", ") :")


class PredictionTrack:
    """Where one request's answer stands in its prediction.

    ``pos``: the prediction's token the answer's next token should be, or ``None`` while the
    answer is off the prediction. ``seen``: how many of the request's tokens were accounted
    for (prompt and output), so each proposal looks only at the tokens new since the last."""

    def __init__(self, prediction: Sequence[int], prompt_len: int) -> None:
        self.tokens = list(prediction)
        self.pos: int | None = 0
        self.seen = prompt_len
        self.last = 0  # the last place the answer was on the prediction: realignment looks after it
        # Each pair of consecutive tokens -> the positions that follow it, ascending.
        self._where: dict[tuple[int, int], list[int]] = {}
        for p in range(KEY, len(self.tokens) + 1):
            self._where.setdefault((self.tokens[p - 2], self.tokens[p - 1]), []).append(p)

    def follow(self, tokens: Sequence[int]) -> int | None:
        """Account for ``tokens`` (the request's prompt and output so far); returns where the
        next token should be in the prediction, or ``None`` when the answer is off it."""
        new = tokens[self.seen :]
        self.seen = len(tokens)
        pos = self.pos
        if pos is not None and self.tokens[pos : pos + len(new)] == list(new):
            self.pos = pos + len(new)
        elif new:
            self.pos = self._rejoin(tokens)
        if self.pos is not None:
            self.last = self.pos
        return self.pos

    def _rejoin(self, context: Sequence[int]) -> int | None:
        """The place after an occurrence of the context's last pair whose tokens before it
        agree longest with the context's (up to ``MAX_MATCH``); among equals, the first past
        where the answer left the prediction (an edit moves forward), else the first.
        ``None``: no place agrees over ``MIN_MATCH`` tokens."""
        n = len(context)
        if n < KEY:
            return None
        places = self._where.get((context[-2], context[-1]))
        if not places:
            return None
        start = bisect_right(places, self.last)
        order = places[start : start + MAX_CANDIDATES]  # after it first, then from the start
        order += places[: min(start, MAX_CANDIDATES - len(order))]
        best, best_len = None, -1
        for p in order:
            length = KEY
            while (
                length < MAX_MATCH
                and p - length - 1 >= 0
                and n - length - 1 >= 0
                and self.tokens[p - length - 1] == context[n - length - 1]
            ):
                length += 1
            if length == p:  # all of the prediction before the place: it may begin here
                length = max(length, MIN_MATCH)
            if length > best_len:
                best, best_len = p, length
        return best if best_len >= MIN_MATCH else None

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens of the prediction from where the answer stands (none when off)."""
        if self.pos is None:
            return []
        return self.tokens[self.pos : self.pos + k]


class PredictionDrafter(Drafter):
    """Drafts from each request's prediction where it has one and its answer follows it;
    otherwise from ``base`` (the server's drafter). With no ``base``, a request with a
    prediction whose answer is off it drafts by prompt lookup over its own text (its prompt,
    which often quotes what the prediction holds, and its answer so far): the client asked
    for drafting; a request without one drafts nothing."""

    name = "prediction"

    def __init__(self, base: Drafter | None) -> None:
        self.base = base
        self._own = NgramDrafter()
        self._tracks: dict[str, PredictionTrack] = {}

    @property
    def fallback(self) -> Drafter:
        """What drafts for a request with a prediction where the prediction cannot."""
        return self.base if self.base is not None else self._own

    def drafts_for(self, req: DraftSource) -> bool:
        """Whether ``req`` can ever be given drafts: it has a prediction, or the server drafts."""
        return self.base is not None or bool(req.prediction)

    def propose(self, req: DraftSource, k: int) -> list[int]:
        if req.prediction:
            return self._from_prediction(req, k) or self.fallback.propose(req, k)
        return [] if self.base is None else self.base.propose(req, k)

    def _from_prediction(self, req: DraftSource, k: int) -> list[int]:
        if not req.prediction:
            return []
        track = self._tracks.get(req.request_id)
        if track is None or track.seen > len(req.token_ids):  # new, or its tokens were cut back
            track = self._tracks[req.request_id] = PredictionTrack(req.prediction, req.prompt_len)
        track.follow(req.token_ids)
        return track.draft(k)

    def prompt_cached(self, req: DraftSource) -> None:
        self.fallback.prompt_cached(req)

    def finished(self, req: DraftSource) -> None:
        self._tracks.pop(req.request_id, None)
        self.fallback.finished(req)

    def reset(self) -> None:
        self.fallback.reset()

    def pool_stats(self) -> dict[str, Any]:
        return self.fallback.pool_stats()

    def check_invariants(self, live: Iterable[str]) -> None:
        live = set(live)
        stale = set(self._tracks) - live
        assert not stale, f"prediction tracks of requests that left: {sorted(stale)}"
        self.fallback.check_invariants(live)

    @property
    def tracked(self) -> int:
        """Requests with a track or a table of their own (tests: none once all finished)."""
        return len(self._tracks) + self._own.tracked
