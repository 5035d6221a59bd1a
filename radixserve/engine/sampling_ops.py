"""Device-side pieces of sampling: top-p without sorting the vocabulary, and penalty counts
that live on the device between steps.

**Top-p by threshold select.** Sorting ``[B, vocab]`` probabilities every step (49k-152k
entries a row) is the most expensive op of a sampling step on a GPU. The nucleus is "every
token at least as likely as the K-th most likely", K the smallest count whose mass reaches
``p``; so it is enough to find that K-th probability. Non-negative float32 values order like
their bit patterns read as int32, so a bisection over the 2**31 bit patterns finds, per row,
the largest threshold whose mass ``sum(p[p >= t])`` still reaches ``p * total``: 31 masked
row sums (accumulated in float64), element-wise work with no sort. Ties at the threshold are all kept (a sort would
keep an arbitrary subset of them).

**Penalty counts.** Repetition (prompt + output tokens seen) and frequency/presence (output
token counts) penalties need a ``[B, vocab]`` table per step. Staging every row's whole
history each step costs a copy of all of it; :class:`PenaltyCounts` keeps one table row per
request on the device instead, in two halves like the sampler: :meth:`PenaltyCounts.plan`
(host) says which table rows the step reads and which tokens are new to them (usually none:
the token sampled last step was already counted on the device by :meth:`PenaltyCounts.advance`);
:meth:`PenaltyCounts.apply` (device) folds those in and gathers the step's rows. The host
lists stay the truth: a row whose history does not continue what was counted (an evicted
entry, a token that was not appended) is rebuilt from them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from radixserve.sampling_params import SamplingParams

_BISECT_STEPS = 31  # bit patterns of non-negative float32 values lie in [0, 2**31)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Per row of ``[B, vocab]`` logits, the index of the largest value (the first of ties;
    a NaN counts as the largest): ``argmax(dim=-1)``, through ``max``, whose CPU kernel took a
    third to a half of argmax's time on the 49k-entry rows of SmolLM2 (torch 2.13: 23 against
    63 us a row at batch 1, 165 against 505 us at 16; ``max`` returns argmax's index)."""
    return logits.max(dim=-1).indices


def top_p_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which entries of ``probs`` ``[B, V]`` (non-negative float32, rows need not sum to 1) are in
    each row's nucleus of mass ``top_p`` ``[B]`` (of the row's total). Rows with ``top_p >= 1``
    keep everything nonzero and then some; callers skip them."""
    bits = probs.contiguous().view(torch.int32)
    # Masses accumulate in float64 (the float32 terms are read once, as for a float32 sum):
    # a float32 sum over 49k-152k entries errs by ~1e-7, enough to move the boundary token.
    target = top_p.to(torch.float64) * probs.sum(-1, dtype=torch.float64)
    lo = torch.zeros(
        probs.shape[0], dtype=torch.int64, device=probs.device
    )  # mass(p >= lo) >= target
    hi = bits.max(-1).values.to(torch.int64) + 1  # mass(p >= hi) == 0 < target
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) // 2
        ok = (
            torch.where(bits >= mid[:, None].to(torch.int32), probs, 0.0).sum(
                -1, dtype=torch.float64
            )
            >= target
        )
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    return bits >= lo[:, None].to(torch.int32)


def has_penalties(p: SamplingParams) -> bool:
    """Whether a request's logits need the penalty tables."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


class PenaltyTables(NamedTuple):
    """The step's rows of the device tables, in the order planned."""

    seen: torch.Tensor  # [R, V] bool: token in the prompt or the output (repetition penalty)
    counts: torch.Tensor  # [R, V] float32: occurrences in the output (frequency/presence)


class PenaltyStep(NamedTuple):
    """Host facts of one step (what :meth:`PenaltyCounts.plan` decided; staged by the sampler)."""

    slots: list[int]  # table row of each penalized sampling row, in order
    reset: list[int]  # table rows to clear first (new or rebuilt entries)
    add_slot: list[int]  # tokens to fold in: their table row,
    add_tok: list[int]  #   the token,
    add_out: list[int]  #   1 when it is an output token (counted for frequency/presence)
    capacity: int  # table rows the device tables need
    # Speculative decoding: a verify row's drafts before it, counted as output tokens in the
    # step's gathered rows only (position in ``slots``, token); never in the tables.
    ahead_row: list[int]
    ahead_tok: list[int]
    # Positions in ``slots`` whose sampled token advance() counts (a verifying request's rows
    # are not: its accepted tokens are folded in from its token list next step).
    advance: list[int]


class _Entry:
    __slots__ = ("row", "slot", "counted")

    def __init__(self, row: Any, slot: int) -> None:
        self.row = weakref.ref(row)
        self.slot = slot
        self.counted = 0  # tokens of row.token_ids folded in, the one sampled last included


class PenaltyCounts:
    """Per-request penalty tables kept on the device (see the module docstring).

    Table rows are reused least-recently-used first (a request evicted and seen again is
    rebuilt from its token list); the tables grow when one step needs more rows.
    """

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.capacity = capacity
        self._seen: torch.Tensor | None = None  # [capacity, V] bool, allocated on first use
        self._counts: torch.Tensor | None = None  # [capacity, V] float32
        self._entries: dict[int, _Entry] = {}  # id(row) -> entry; insertion order = LRU order
        self._free = list(range(capacity - 1, -1, -1))
        self.rebuilds = 0  # rows filled from their whole history (tests read it)

    # -- host half -------------------------------------------------------------------------

    def plan(
        self, rows: Sequence[Any], ahead: Sequence[list[int] | None] | None = None
    ) -> PenaltyStep:
        """Table rows of ``rows`` (each with ``token_ids`` and ``prompt_len``) and what is new to
        them; counts each row's next sampled token as already folded in (see :meth:`advance`).

        ``ahead`` (speculative decoding): per row, the drafts before it among its request's
        verify rows (``[]`` for the first; None: not a verify row). A request's later verify
        rows read its table row plus their drafts; none of its rows advances the table, so
        the tokens that stood are folded in from its token list at its next step."""
        step = PenaltyStep([], [], [], [], [], 0, [], [], [])
        for i, r in enumerate(rows):
            a = ahead[i] if ahead is not None else None
            if a:  # a later verify row of the request planned just before
                step.ahead_row.extend([len(step.slots)] * len(a))
                step.ahead_tok.extend(a)
                step.slots.append(step.slots[-1])
                continue
            e = self._entries.pop(id(r), None)
            if e is not None and e.row() is not r:  # a dead row's id reused
                self._free.append(e.slot)
                e = None
            if e is None:
                e = _Entry(r, self._alloc(len(rows)))
            self._entries[id(r)] = e  # most recently used last
            ids = r.token_ids
            if len(ids) < e.counted:  # the history does not continue what was counted
                e.counted = 0
            if e.counted == 0:
                step.reset.append(e.slot)
                self.rebuilds += 1
            new = ids[e.counted :]
            step.add_slot.extend([e.slot] * len(new))
            step.add_tok.extend(new)
            step.add_out.extend(int(e.counted + k >= r.prompt_len) for k in range(len(new)))
            if a is None:  # this step's sampled token, counted on the device by advance()
                e.counted = len(ids) + 1
                step.advance.append(len(step.slots))
            else:
                e.counted = len(ids)
            step.slots.append(e.slot)
        return step._replace(capacity=self.capacity)

    def _alloc(self, batch: int) -> int:
        if not self._free:
            if (
                len(self._entries) >= batch
            ):  # evict the least recently used row (not one of this step's)
                oldest = next(iter(self._entries))
                self._free.append(self._entries.pop(oldest).slot)
            else:  # one step needs more rows than there are: the device tables grow in apply()
                self._free = list(range(2 * self.capacity - 1, self.capacity - 1, -1))
                self.capacity *= 2
        return self._free.pop()

    # -- device half -----------------------------------------------------------------------

    def apply(
        self,
        step: PenaltyStep,
        slots: torch.Tensor,
        reset: torch.Tensor | None,
        add: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        ahead: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> PenaltyTables:
        """Fold the planned tokens in and gather the step's rows. ``slots``/``reset``/``add``
        (slot, token, is-output)/``ahead`` (row, draft) are ``step``'s lists as device int64
        tensors (staged)."""
        self._ensure(step.capacity)
        assert self._seen is not None and self._counts is not None
        if reset is not None:
            self._seen.index_fill_(0, reset, False)
            self._counts.index_fill_(0, reset, 0.0)
        if add is not None:
            a_slot, a_tok, a_out = add
            self._seen[a_slot, a_tok] = True
            self._counts.index_put_((a_slot, a_tok), a_out.to(torch.float32), accumulate=True)
        seen, counts = self._seen.index_select(0, slots), self._counts.index_select(0, slots)
        if ahead is not None:  # verify rows: their drafts count as output, in this copy only
            h_row, h_tok = ahead
            seen[h_row, h_tok] = True
            counts.index_put_(
                (h_row, h_tok), torch.ones_like(h_tok, dtype=torch.float32), accumulate=True
            )
        return PenaltyTables(seen, counts)

    def advance(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count this step's sampled ``tokens`` (one per planned row, device) as output tokens."""
        assert self._seen is not None and self._counts is not None
        tok = tokens.to(torch.int64)
        self._seen[slots, tok] = True
        self._counts.index_put_(
            (slots, tok), torch.ones_like(tok, dtype=torch.float32), accumulate=True
        )

    def _ensure(self, capacity: int) -> None:
        if self._seen is None:
            self._seen = torch.zeros(
                capacity, self.vocab_size, dtype=torch.bool, device=self.device
            )
            self._counts = torch.zeros(
                capacity, self.vocab_size, dtype=torch.float32, device=self.device
            )
        elif self._seen.shape[0] < capacity:
            assert self._counts is not None
            grow = capacity - self._seen.shape[0]
            self._seen = torch.cat([self._seen, self._seen.new_zeros(grow, self.vocab_size)])
            self._counts = torch.cat([self._counts, self._counts.new_zeros(grow, self.vocab_size)])
