"""A thinking budget: a reasoning model's ``<think>`` block closed after a set number of tokens.

Reasoning models (Qwen3, DeepSeek-R1, QwQ, SmolLM3) think between ``<think>`` and
``</think>`` (Magistral between ``[THINK]`` and ``[/THINK]``, Kimi between ``◁think▷`` and
``◁/think▷``: :data:`MARKER_PAIRS`) before they answer, and nothing in the model bounds how long: asked a small
thing, one can think until ``max_tokens`` runs out and never answer. With
``SamplingParams.thinking_token_budget`` (vLLM's name; the Messages API's
``thinking.budget_tokens``) the engine counts the tokens written inside the block and, once
the budget is spent, forces the closing sequence (``"\\n"`` and ``</think>``) token by token,
masking everything else, as vLLM's thinking-budget state, SGLang's strict thinking and
llama.cpp's reasoning-budget sampler do. The answer that follows is the model's own.

:class:`ThinkingBudget` does this through the interface of
:class:`~radixserve.constrained.matcher.GrammarMatcher` (``accept``, ``next_mask``,
``mask_at``, ``lookahead``, ``can_only_end``), so the sampler masks its rows and the scheduler
advances it like any constraint; a request's own grammar, when it has one, is wrapped::

    idle ── <think> ──> thinking ── budget spent ──> forcing "\\n" </think> ──> idle
                          └──────── </think> (the model closes it) ─────────────┘

The block may open in the prompt (DeepSeek-R1's template, Qwen3's thinking-only models):
then counting starts with the first output token. The budget is the whole answer's: a second
block, should the model open one, gets what the first left. Under a grammar that forbids the
next forced token, the grammar wins (that budget cannot be kept by masking).

A budget spent in the middle of a character (byte-level BPE splits rarer characters, CJK and
emoji among them, over several tokens) is not cut there, as llama.cpp's reasoning budget does
not: the block stays open, unforced, until the character is whole, at most
:data:`MAX_CHARACTER_WAIT` tokens more (a character is at most four bytes), so that the
reasoning does not end in U+FFFD. The tokens of that wait count as thinking tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from radixserve.constrained.bits import allows, bitmask_words, every_token, only_token
from radixserve.token_bytes import pending_bytes

if TYPE_CHECKING:
    from radixserve.constrained.matcher import GrammarMatcher

START_MARKER, END_MARKER = "<think>", "</think>"
# Every think block a model may write, by its markup: ``<think>`` (Qwen3, DeepSeek-R1, GLM),
# ``[THINK]`` (Magistral) and ``◁think▷`` (Kimi); a tokenizer's first pair of single tokens
# is its (agents/reasoning.py reads the same blocks out of answers).
MARKER_PAIRS = (
    (START_MARKER, END_MARKER),
    ("[THINK]", "[/THINK]"),
    ("\u25c1think\u25b7", "\u25c1/think\u25b7"),
)
# Tokens a spent budget waits, at most, for the character in progress to end: its lead byte
# was written, and at most three bytes follow it, each token adding at least one.
MAX_CHARACTER_WAIT = 3


class ThinkMarkers(NamedTuple):
    """One tokenizer's reasoning markers: the ids of ``<think>`` and ``</think>`` and the
    tokens forced to close a block (a newline, then ``</think>``)."""

    start: int
    end: int
    close: tuple[int, ...]


def think_markers(tokenizer: Any) -> ThinkMarkers | None:
    """The markers of ``tokenizer`` (a transformers tokenizer): the first pair of
    :data:`MARKER_PAIRS` whose both halves are one token of its vocabulary each, or None (a
    model that does not reason so)."""
    for start, end in MARKER_PAIRS:
        ids = [tokenizer.encode(marker, add_special_tokens=False) for marker in (start, end)]
        if all(len(encoded) == 1 for encoded in ids):
            begin, close = int(ids[0][0]), int(ids[1][0])
            newline = [int(t) for t in tokenizer.encode("\n", add_special_tokens=False)]
            return ThinkMarkers(begin, close, (*newline, close))
    return None


class _State(Enum):
    IDLE = "idle"  # outside a block: watching for <think>
    THINKING = "thinking"  # inside one, counting
    FINISHING = "finishing"  # the budget is spent mid-character: the character ends first
    FORCING = "forcing"  # the budget is spent: the closing tokens, one by one


class ThinkingBudget:
    """One request's thinking budget (see the module doc), wrapping its grammar if any.

    ``token_bytes``: each token's bytes (:class:`~radixserve.token_bytes.TokenBytes`), to let
    a character in progress end before the block is closed; None: closed where the budget
    ends."""

    def __init__(
        self,
        budget: int,
        markers: ThinkMarkers,
        vocab_size: int,
        prompt_ids: Sequence[int],
        inner: GrammarMatcher | None = None,
        token_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        self.budget = budget
        self.markers = markers
        self.inner = inner  # the request's GrammarMatcher, or None
        self.used = 0  # tokens written inside blocks so far
        self._token_bytes = token_bytes
        # The block's last tokens (enough to hold a character's bytes), and the tokens waited
        # so far for the character in progress to end (FINISHING).
        self._recent: deque[int] = deque(maxlen=MAX_CHARACTER_WAIT + 1)
        self._waited = 0
        self._words = bitmask_words(vocab_size)
        self._all = every_token(self._words)
        self._state = _State.IDLE
        self._forced = 0  # closing tokens written (FORCING)
        self.next_mask = self._all
        if _opens_in(prompt_ids, markers):
            self._inside()
        self._refresh()

    @property
    def failure(self) -> str | None:
        """Why the wrapped grammar refused a token it allows (GrammarMatcher.failure)."""
        return None if self.inner is None else self.inner.failure

    @property
    def can_only_end(self) -> bool:
        return (
            self._state is not _State.FORCING and self.inner is not None and self.inner.can_only_end
        )

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (nothing changed) when the wrapped grammar
        does not allow it."""
        if self.inner is not None and not self.inner.accept(token_id):
            return False
        m = self.markers
        if self._state is _State.FORCING:
            self._forced += 1
            if token_id != m.close[self._forced - 1] or self._forced == len(m.close):
                self._state = _State.IDLE  # closed (or the grammar overruled the rest)
        elif self._state in (_State.THINKING, _State.FINISHING):
            if token_id == m.end:
                self._state = _State.IDLE
            else:
                self.used += 1
                self._waited += self._state is _State.FINISHING
                self._recent.append(token_id)
                self._inside()
        elif token_id == m.start:
            self._recent.clear()
            self._waited = 0
            self._inside()
        self._refresh()
        return True

    def _inside(self) -> None:
        """Inside a block: counting; once the budget is spent, the character in progress
        ended (module doc); then closing."""
        if self.used < self.budget:
            self._state = _State.THINKING
        elif self._waited < MAX_CHARACTER_WAIT and self._mid_character():
            self._state = _State.FINISHING
        else:
            self._state, self._forced = _State.FORCING, 0

    def _mid_character(self) -> bool:
        """Whether the block's text so far ends inside a character."""
        if self._token_bytes is None or not self._recent:
            return False
        return pending_bytes(b"".join(self._token_bytes(t) for t in self._recent)) > 0

    def lookahead(self, draft: Sequence[int]) -> int:
        """How many leading tokens of a speculative ``draft`` may be verified: none while the
        closing tokens are forced or a character in progress ends, only as many as leave
        every verify row short of the budget while thinking, and none past a ``<think>``
        (counting would start there); within that, what the wrapped grammar allows."""
        if self._state in (_State.FORCING, _State.FINISHING):
            n = 0
        elif self._state is _State.THINKING:
            n = max(0, min(len(draft), self.budget - self.used - 1))
        else:
            n = next((i for i, t in enumerate(draft) if t == self.markers.start), len(draft))
        return n if self.inner is None else self.inner.lookahead(draft[:n])

    def mask_at(self, j: int) -> torch.Tensor:
        """The mask of the verify row ``j`` tokens into the last :meth:`lookahead` (rows past
        the first are never forced: the draft stops short of that)."""
        if j == 0:
            return self.next_mask
        return self.inner.mask_at(j) if self.inner is not None else self._all

    def _refresh(self) -> None:
        inner = self.inner.next_mask if self.inner is not None else self._all
        self.next_mask = inner
        if self._state is _State.FORCING:
            token = self.markers.close[self._forced]
            if allows(inner, token):
                self.next_mask = only_token(self._words, token)

    def __repr__(self) -> str:
        return (
            f"ThinkingBudget(budget={self.budget}, used={self.used}, state={self._state.value}, "
            f"inner={self.inner!r})"
        )


def _opens_in(prompt_ids: Sequence[int], markers: ThinkMarkers) -> bool:
    """Whether the prompt ends inside a block: its last marker is ``<think>``."""
    for t in reversed(prompt_ids):
        if t == markers.start:
            return True
        if t == markers.end:
            return False
    return False
