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
token counts) penalties need a ``[B, vocab]`` table per step. Rebuilding it from the host
token lists costs a copy of every row's whole history each step; :class:`PenaltyCounts` keeps
one table row per request on the device instead, filled from the history once, then updated
on the device with each step's sampled tokens. The host lists stay the truth: a row whose
history no longer matches what was counted (rare: an evicted entry, an edited history) is
rebuilt from them.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Sequence

import torch

from radixserve.sampling_params import SamplingParams

_BISECT_STEPS = 31  # bit patterns of non-negative float32 values lie in [0, 2**31)


def top_p_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which entries of ``probs`` ``[B, V]`` (non-negative float32, rows need not sum to 1) are in
    each row's nucleus of mass ``top_p`` ``[B]`` (of the row's total). Rows with ``top_p >= 1``
    keep everything nonzero and then some; callers skip them."""
    bits = probs.contiguous().view(torch.int32)
    # Masses accumulate in float64 (the float32 terms are read once, as for a float32 sum):
    # a float32 sum over 49k-152k entries errs by ~1e-7, enough to move the boundary token.
    target = top_p.to(torch.float64) * probs.sum(-1, dtype=torch.float64)
    lo = torch.zeros(probs.shape[0], dtype=torch.int64, device=probs.device)  # mass(p >= lo) >= target
    hi = bits.max(-1).values.to(torch.int64) + 1  # mass(p >= hi) == 0 < target
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) // 2
        ok = torch.where(bits >= mid[:, None].to(torch.int32), probs, 0.0).sum(-1, dtype=torch.float64) >= target
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    return bits >= lo[:, None].to(torch.int32)


def has_penalties(p: SamplingParams) -> bool:
    """Whether a request's logits need the penalty tables."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


class PenaltyTables(NamedTuple):
    """The batch's rows of the device tables, in the order asked for."""

    seen: torch.Tensor  # [B, V] bool: token in the prompt or the output (repetition penalty)
    counts: torch.Tensor  # [B, V] float32: occurrences in the output (frequency/presence)


class _Entry:
    __slots__ = ("row", "slot", "counted", "last")

    def __init__(self, row: Any, slot: int) -> None:
        self.row = weakref.ref(row)
        self.slot = slot
        self.counted = 0  # tokens of row.token_ids folded into the tables
        self.last = -1  # token_ids[counted - 1] when it was counted


class PenaltyCounts:
    """Per-request penalty tables kept on the device (see the module docstring).

    ``capacity`` table rows, reused least-recently-used first (a request evicted and seen
    again is rebuilt from its token list); grows when one batch needs more rows.
    """

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._seen = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self._counts = torch.zeros(capacity, vocab_size, dtype=torch.float32, device=device)
        self._entries: dict[int, _Entry] = {}  # id(row) -> entry; insertion order = LRU order
        self._free = list(range(capacity - 1, -1, -1))
        self.rebuilds = 0  # rows filled from their whole history (tests read it)

    @property
    def capacity(self) -> int:
        return self._seen.shape[0]

    def tables(self, rows: Sequence[Any]) -> PenaltyTables:
        """The tables of ``rows`` (each with ``token_ids`` and ``prompt_len``), brought up to date."""
        slots = [self._sync(r, len(rows)) for r in rows]
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return PenaltyTables(self._seen.index_select(0, idx), self._counts.index_select(0, idx))

    def advance(self, rows: Sequence[Any], tokens: torch.Tensor, tokens_host: Sequence[int]) -> None:
        """Count this step's sampled ``tokens`` (device ``[B]``, the same values as ``tokens_host``)
        for ``rows`` on the device, ahead of their being appended to the rows' token lists."""
        slots = []
        for r, t in zip(rows, tokens_host):
            e = self._entries[id(r)]
            e.counted += 1
            e.last = t
            slots.append(e.slot)
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        tok = tokens.to(torch.int64)
        self._counts.index_put_((idx, tok), torch.ones_like(tok, dtype=torch.float32), accumulate=True)
        self._seen[idx, tok] = True

    def _sync(self, row: Any, batch: int) -> int:
        e = self._entries.pop(id(row), None)
        if e is not None and e.row() is not row:  # a dead row's id reused
            self._release(e)
            e = None
        if e is None:
            e = _Entry(row, self._alloc(batch))
        self._entries[id(row)] = e  # most recently used last
        ids = row.token_ids
        n = len(ids)
        if e.counted and (n < e.counted or ids[e.counted - 1] != e.last):
            e.counted = 0  # the history changed under us: count it again
        if e.counted == 0:
            self._seen[e.slot].zero_()
            self._counts[e.slot].zero_()
            self.rebuilds += 1
        if n > e.counted:
            self._add(e.slot, ids[e.counted :], max(0, row.prompt_len - e.counted))
            e.counted, e.last = n, ids[-1]
        return e.slot

    def _add(self, slot: int, tokens: Sequence[int], num_prompt: int) -> None:
        t = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        self._seen[slot, t] = True
        out = t[num_prompt:]
        if out.numel():
            self._counts[slot].index_put_((out,), torch.ones_like(out, dtype=torch.float32), accumulate=True)

    def _alloc(self, batch: int) -> int:
        if not self._free:
            if len(self._entries) >= batch:  # evict the least recently used row
                oldest = next(iter(self._entries))
                self._release(self._entries.pop(oldest))
            else:  # one batch needs more rows than there are
                old = self.capacity
                self._seen = torch.cat([self._seen, torch.zeros_like(self._seen)])
                self._counts = torch.cat([self._counts, torch.zeros_like(self._counts)])
                self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _release(self, e: _Entry) -> None:
        self._free.append(e.slot)
