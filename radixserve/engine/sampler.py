"""Batched sampling: one pass over a step's logits for every request in it.

Order of operations, per row (each stage runs only when some row in the batch uses it)::

    raw logits ──> log_softmax ──> chosen/top-k logprobs, and the logprobs of the token ids a
         │                         row asked for (SGLang's token_ids_logprob), reported from the
         │                         model's distribution
         │
         ├─ repetition penalty (prompt + output tokens, HF style: divide positive, multiply negative)
         ├─ frequency / presence penalties (output tokens, OpenAI style); the seen/count tables
         │  stay on the device between steps (sampling_ops.PenaltyCounts)
         ├─ min_tokens: EOS and stop ids masked until enough tokens are out; bad_words: the
         │  token that would complete one masked
         ├─ allowed_token_ids: every other token of the row masked
         ├─ logit_bias: (row, token) += bias, before temperature/top-k/p and the grammar mask
         ├─ grammar: tokens a constrained row's grammar forbids -> -inf (those rows only)
         ├─ greedy rows: argmax (through max, faster on the CPU)
         └─ other rows: / temperature -> top-k -> softmax -> min-p -> top-p -> inverse-CDF draw
                         (top-k is a selection, top-p a threshold bisection: no vocabulary sort)

Split in two halves so that a step has one host-to-device copy and one read back:

- :meth:`Sampler.prepare` (host) reads the requests and writes every per-row value the
  device needs (temperatures, top-k/p, min-p, penalties and the tokens new to their tables,
  min_tokens blocks, grammar bitmasks, the uniform draws) into the step's
  :class:`~radixserve.engine.staging.StagingLayout`; it returns a :class:`SamplingPlan` of
  host facts (which stages run, which rows report logprobs).
- :meth:`Sampler.sample_staged` (device) uses only views of the uploaded buffer and returns
  device tensors; nothing in it reads the device back.

The draw uses one uniform number per row, drawn on the host; a request with a seed owns a
``torch.Generator`` so its samples do not depend on what else is in the batch.

Speculative decoding: a sampled row that verifies a draft (``drafts``, one per row) draws a
second uniform, for the accept test, and its token comes from rejection sampling
(:func:`~radixserve.speculative.rejection.rejection_sample`): the draft if it stands, else a
draw from the residual. Greedy rows take the argmax, drafts or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from radixserve.bad_words import MAX_WORD_TOKENS, banned_next
from radixserve.constrained.interface import TokenGrammar
from radixserve.engine.allowed_tokens import apply_allowed, only_end_tokens, stage_allowed
from radixserve.engine.logit_bias import apply_bias, stage_bias
from radixserve.engine.sampling_ops import (
    PenaltyCounts,
    PenaltyStep,
    greedy,
    has_penalties,
    top_p_keep,
)
from radixserve.engine.staging import Staged, StagingBuffer, StagingLayout
from radixserve.sampling_params import SamplingParams
from radixserve.scheduling.types import RowLogprobs
from radixserve.speculative.rejection import NO_DRAFT, inverse_cdf, rejection_sample


class SamplingRow(Protocol):
    """What the sampler reads from a request (implemented by ``Request``)."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    prompt_len: int
    generator: torch.Generator | None
    grammar: TokenGrammar | None


class SampleResult(NamedTuple):
    """Chosen tokens of one step, plus logprobs for the rows that asked for them."""

    token_ids: list[int]
    logprobs: list[RowLogprobs | None]  # None for a row that did not ask


class SamplingPlan(NamedTuple):
    """Host facts about one step's sampling (what :meth:`Sampler.prepare` staged)."""

    num_rows: int
    all_greedy: bool
    lp_rows: list[int]  # rows that report logprobs
    lp_k: list[int]  # top logprobs each of them wants
    k_max: int  # max(lp_k)
    penalties: (
        PenaltyStep | None
    )  # rows with a repetition/frequency/presence penalty (None: stage skipped)
    blocked: int  # (row, token) pairs masked by min_tokens
    constrained: list[int]  # rows with a grammar
    eos_guard_rows: list[int]  # rows with a grammar and ignore_eos
    top_k_max: int  # 0: no row uses top-k
    any_min_p: bool
    any_top_p: bool
    biased: int = 0  # (row, token) pairs with a logit_bias
    verifies: bool = False  # some sampled row verifies a draft (rejection sampling)
    limited: int = 0  # rows drawing from their allowed_token_ids only
    lp_ids: Sequence[Sequence[int]] = ()  # per row of lp_rows: the token ids it asked for
    ids_max: int = 0  # max(len(ids) for ids in lp_ids)


class SampleTensors(NamedTuple):
    """One step's sampling results, on the device."""

    token_ids: torch.Tensor  # [B] int64
    chosen_logprobs: torch.Tensor  # [L] float32, rows of plan.lp_rows
    top_ids: torch.Tensor  # [L, k_max] int64
    top_logprobs: torch.Tensor  # [L, k_max] float32
    id_logprobs: torch.Tensor  # [L, ids_max] float32: the asked-for tokens' (padded)


class _Draw(NamedTuple):
    """What :meth:`Sampler._stage_draw` staged: whether every row is greedy, and which of
    the draw's filters and checks some row needs."""

    all_greedy: bool
    top_k_max: int
    any_min_p: bool
    any_top_p: bool
    verifies: bool


class Sampler:
    """Samples the next token of each row of a ``[B, vocab]`` logits tensor."""

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        # Unseeded rows draw from this generator (the engine's seed makes runs reproducible).
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)
        eos = [t for t in self.eos_token_ids if 0 <= t < vocab_size]
        self._eos = torch.tensor(
            eos, dtype=torch.int64, device=self.device
        )  # made once: no per-step copy
        self._staging: StagingBuffer | None = None
        self.penalty_counts = PenaltyCounts(vocab_size, self.device)

    def new_generator(self, seed: int) -> torch.Generator:
        """A per-request generator for ``params.seed``."""
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        return g

    # -- host half -------------------------------------------------------------------------

    def prepare(
        self,
        rows: Sequence[SamplingRow],
        layout: StagingLayout,
        drafts: Sequence[int] | None = None,
    ) -> SamplingPlan:
        """Stage every per-row input of this step's sampling into ``layout`` (host only).
        ``drafts``: per row, the drafted token it verifies or ``NO_DRAFT`` (speculative
        decoding); None: no row verifies one."""
        params = [r.params for r in rows]
        ahead = drafts_before(rows, drafts)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        lp_k = [params[i].logprobs or 0 for i in lp_rows]
        lp_ids = [params[i].logprob_token_ids or [] for i in lp_rows]
        ids_max = max(map(len, lp_ids), default=0)
        if lp_rows:
            layout.ints("s.lp_rows", lp_rows)
        if ids_max:
            layout.ints("s.lp_ids", padded_ids(lp_ids))
        pen_step = self._stage_penalties(rows, ahead, layout)
        blocked = self._stage_blocks(rows, ahead, layout)
        biased = stage_bias(params, layout, self.vocab_size)
        limited = stage_allowed(params, layout)
        constrained, eos_guard = self._stage_grammars(rows, ahead, layout)
        draw = self._stage_draw(rows, drafts, layout)
        return SamplingPlan(
            len(rows),
            draw.all_greedy,
            lp_rows,
            lp_k,
            max(lp_k, default=0),
            pen_step,
            blocked,
            constrained,
            eos_guard,
            draw.top_k_max,
            draw.any_min_p,
            draw.any_top_p,
            biased,
            draw.verifies,
            limited,
            lp_ids,
            ids_max,
        )

    def _stage_penalties(
        self, rows: Sequence[SamplingRow], ahead: list[list[int] | None], layout: StagingLayout
    ) -> PenaltyStep | None:
        """Stage the penalized rows' numbers, their count-table updates and their penalties.
        The tables live on the device: only row numbers and new tokens travel."""
        params = [r.params for r in rows]
        pen = [i for i, p in enumerate(params) if has_penalties(p)]
        if not pen:
            return None
        step = self.penalty_counts.plan([rows[i] for i in pen], [ahead[i] for i in pen])
        layout.ints("s.pen_rows", pen)
        layout.ints("s.pen_slots", step.slots)
        if step.reset:
            layout.ints("s.pen_reset", step.reset)
        if step.add_slot:
            layout.ints("s.pen_add_slot", step.add_slot)
            layout.ints("s.pen_add_tok", step.add_tok)
            layout.ints("s.pen_add_out", step.add_out)
        if step.ahead_row:
            layout.ints("s.pen_ahead_row", step.ahead_row)
            layout.ints("s.pen_ahead_tok", step.ahead_tok)
        if step.advance and len(step.advance) < len(pen):
            layout.ints("s.pen_adv", step.advance)
        layout.floats("s.rep_pen", [params[i].repetition_penalty for i in pen])
        layout.floats("s.freq_f", [params[i].frequency_penalty for i in pen])
        layout.floats("s.freq_p", [params[i].presence_penalty for i in pen])
        return step

    def _stage_grammars(
        self, rows: Sequence[SamplingRow], ahead: list[list[int] | None], layout: StagingLayout
    ) -> tuple[list[int], list[int]]:
        """Stage the constrained rows' token masks; returns those rows, and the ones among
        them whose end token must stay masked (``ignore_eos`` under a grammar)."""
        grammars = [getattr(r, "grammar", None) for r in rows]
        constrained = [i for i, g in enumerate(grammars) if g is not None]
        if constrained:
            layout.ints("s.mask_rows", constrained)
            # A verify row's mask is the grammar's after the drafts before it (lookahead).
            masks = [
                g.mask_at(len(ahead[i] or ())) for i, g in enumerate(grammars) if g is not None
            ]
            layout.int_tensor("s.mask", torch.cat(masks))
        # (A thinking budget alone masks no end token: only a grammar's rows are guarded.)
        guarded = [
            i for i in constrained if rows[i].params.ignore_eos and rows[i].params.constraint
        ]
        return constrained, guarded if len(self._eos) else []

    def _stage_draw(
        self, rows: Sequence[SamplingRow], drafts: Sequence[int] | None, layout: StagingLayout
    ) -> _Draw:
        """Stage what the draw of a step with sampled rows needs (temperatures, the filters
        some row asks for, the uniforms, the drafts verified); nothing when all are greedy."""
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        if all(greedy):
            return _Draw(True, 0, False, False, False)
        layout.ints("s.greedy", [int(g) for g in greedy])
        layout.floats("s.temp", [1.0 if p.greedy else p.temperature for p in params])
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_k_max = min(max(top_k), self.vocab_size)
        if top_k_max:
            layout.ints("s.top_k", top_k)
        any_min_p = any(p.min_p for p in params)
        if any_min_p:
            layout.floats("s.min_p", [p.min_p for p in params])
        any_top_p = any(p.top_p < 1.0 for p in params)
        if any_top_p:
            layout.floats("s.top_p", [p.top_p for p in params])
        layout.floats("s.u", self._uniforms(rows))
        verifies = self._stage_drafts(rows, drafts, layout)
        return _Draw(False, top_k_max, any_min_p, any_top_p, verifies)

    def _stage_blocks(
        self, rows: Sequence[SamplingRow], ahead: list[list[int] | None], layout: StagingLayout
    ) -> int:
        """Stage the (row, token) pairs masked this step: what ``min_tokens`` blocks (EOS and
        stop ids while the output, drafts before a verify row included, is short) and the
        tokens that would complete a bad word (:mod:`radixserve.bad_words`); returns how many."""
        blocked_r: list[int] = []
        blocked_t: list[int] = []
        for i, r in enumerate(rows):
            for t in self._blocked(r, ahead[i] or []):
                if 0 <= t < self.vocab_size:
                    blocked_r.append(i)
                    blocked_t.append(t)
        if blocked_r:
            layout.ints("s.block_r", blocked_r)
            layout.ints("s.block_t", blocked_t)
        return len(blocked_r)

    def _blocked(self, r: SamplingRow, ahead: list[int]) -> list[int]:
        """The tokens row ``r`` may not draw this step."""
        p, out = r.params, []
        if p.min_tokens and len(r.token_ids) - r.prompt_len + len(ahead) < p.min_tokens:
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            if not only_end_tokens(p, ids):  # blocking them all would leave nothing to draw
                out += ids
        if p.bad_words_token_ids:  # a word's head is at most MAX_WORD_TOKENS - 1 long
            tail = r.token_ids[max(r.prompt_len, len(r.token_ids) - MAX_WORD_TOKENS) :]
            out += banned_next(p.bad_words_token_ids, [*tail, *ahead])
        return out

    def _stage_drafts(
        self, rows: Sequence[SamplingRow], drafts: Sequence[int] | None, layout: StagingLayout
    ) -> bool:
        """Stage the drafts that sampled rows verify and their accept-test uniforms (a seeded
        row draws its own, after its draw's); whether there is any."""
        if drafts is None:
            return False
        verify = [
            d if d != NO_DRAFT and not r.params.greedy else NO_DRAFT for r, d in zip(rows, drafts)
        ]
        if all(d == NO_DRAFT for d in verify):
            return False
        u = torch.rand(len(rows), generator=self._generator, dtype=torch.float64)
        for i, (r, d) in enumerate(zip(rows, verify)):
            if d != NO_DRAFT and r.generator is not None:
                u[i] = torch.rand((), generator=r.generator)
        layout.ints("s.draft", verify)
        layout.floats("s.u_accept", u.tolist())
        return True

    def _uniforms(self, rows: Sequence[SamplingRow]) -> list[float]:
        u = torch.rand(len(rows), generator=self._generator, dtype=torch.float64)
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = torch.rand((), generator=r.generator)
        return u.tolist()  # a host tensor: no device read

    # -- device half -----------------------------------------------------------------------

    def sample_staged(
        self,
        logits: torch.Tensor,
        plan: SamplingPlan,
        staged: Staged,
        draft_probs: torch.Tensor | None = None,
    ) -> SampleTensors:
        """Pick one token per row of ``logits`` (``[B, vocab]``) from the staged inputs (device
        only). ``draft_probs`` ``[B, vocab]``: the drafter's distribution of each row that
        verifies a draft (a draft model's); None: the drafts are point masses."""
        logits = logits.float()
        raw_lp = None
        if plan.lp_rows:
            raw_lp = torch.log_softmax(logits.index_select(0, staged.i("s.lp_rows")), dim=-1)
        logits = self._processed(logits, plan, staged)
        if plan.all_greedy:
            chosen = greedy(logits)
        else:
            chosen = self._draw(logits, plan, staged, draft_probs)
        if plan.penalties is not None:  # next step's tables already hold this step's tokens
            self._advance_penalties(plan.penalties, staged, chosen)
        dev = logits.device
        if raw_lp is None:
            empty = torch.empty(0, dtype=torch.float32, device=dev)
            none = empty.view(0, 0)
            return SampleTensors(
                chosen, empty, torch.empty(0, 0, dtype=torch.int64, device=dev), none, none
            )
        chosen_lp = raw_lp.gather(
            1, chosen.index_select(0, staged.i("s.lp_rows"))[:, None]
        ).squeeze(1)
        top_v, top_i = (
            raw_lp.topk(plan.k_max, dim=-1) if plan.k_max else (raw_lp[:, :0], raw_lp[:, :0].long())
        )
        id_lp = (
            raw_lp.gather(1, staged.i("s.lp_ids").view(-1, plan.ids_max))
            if plan.ids_max
            else raw_lp[:, :0]
        )
        return SampleTensors(chosen, chosen_lp, top_i, top_v, id_lp)

    def _advance_penalties(self, step: PenaltyStep, staged: Staged, chosen: torch.Tensor) -> None:
        slots, rows = staged.i("s.pen_slots"), staged.i("s.pen_rows")
        if not step.advance:  # every penalized row verifies drafts
            return
        if len(step.advance) < len(step.slots):
            adv = staged.i("s.pen_adv")
            slots, rows = slots.index_select(0, adv), rows.index_select(0, adv)
        self.penalty_counts.advance(slots, chosen.index_select(0, rows))

    def _processed(self, logits: torch.Tensor, plan: SamplingPlan, staged: Staged) -> torch.Tensor:
        """Penalties, min_tokens blocks, logit biases and grammar masks applied (a copy when
        any applies)."""
        if not (
            plan.penalties is not None
            or plan.blocked
            or plan.constrained
            or plan.biased
            or plan.limited
        ):
            return logits
        logits = logits.clone()  # the caller's logits stay the model's
        if plan.penalties is not None:
            step = plan.penalties
            tables = self.penalty_counts.apply(
                step,
                staged.i("s.pen_slots"),
                staged.i("s.pen_reset") if step.reset else None,
                (staged.i("s.pen_add_slot"), staged.i("s.pen_add_tok"), staged.i("s.pen_add_out"))
                if step.add_slot
                else None,
                (staged.i("s.pen_ahead_row"), staged.i("s.pen_ahead_tok"))
                if step.ahead_row
                else None,
            )
            rows = staged.i("s.pen_rows")
            sub = logits.index_select(0, rows)
            rep = staged.f("s.rep_pen").float()[:, None]  # 1.0 on rows without it: unchanged
            sub = torch.where(tables.seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
            f = staged.f("s.freq_f").float()[:, None]
            p = staged.f("s.freq_p").float()[:, None]
            logits.index_copy_(0, rows, sub - (tables.counts * f + (tables.counts > 0).float() * p))
        if plan.limited:
            apply_allowed(logits, plan.limited, staged)
        if plan.blocked:
            logits[staged.i("s.block_r"), staged.i("s.block_t")] = float("-inf")
        if plan.biased:
            apply_bias(logits, staged)
        if plan.constrained:
            self._apply_grammar(logits, plan, staged)
        return logits

    def _apply_grammar(self, logits: torch.Tensor, plan: SamplingPlan, staged: Staged) -> None:
        from radixserve.constrained.mask import apply_bitmask  # xgrammar loads only when used

        rows = staged.i("s.mask_rows")
        mask = staged.i("s.mask").to(torch.int32).view(len(plan.constrained), -1)
        full = torch.full(
            (logits.shape[0], mask.shape[1]), -1, dtype=torch.int32, device=logits.device
        )
        full.index_copy_(0, rows, mask)  # all ones (everything allowed) on unconstrained rows
        apply_bitmask(logits, full)
        # ignore_eos under a grammar: the end token only where the grammar allows nothing else.
        for i in plan.eos_guard_rows:
            allowed = torch.isfinite(logits[i])
            others = allowed.sum() > allowed.index_select(0, self._eos).sum()
            eos_logits = logits[i].index_select(0, self._eos)
            logits[i].index_copy_(0, self._eos, torch.where(others, float("-inf"), eos_logits))

    def _draw(
        self,
        logits: torch.Tensor,
        plan: SamplingPlan,
        staged: Staged,
        draft_probs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        greedy_rows = staged.i("s.greedy").bool()
        scaled = logits / staged.f("s.temp").float()[:, None]
        if plan.top_k_max:
            k_max = plan.top_k_max
            top_k = staged.i("s.top_k")
            kth_idx = torch.where(top_k > 0, top_k.clamp(max=k_max) - 1, k_max - 1)
            kth = scaled.topk(k_max, dim=-1).values.gather(1, kth_idx[:, None])
            scaled = scaled.masked_fill((top_k > 0)[:, None] & (scaled < kth), float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if plan.any_min_p:
            thresh = probs.max(dim=-1, keepdim=True).values * staged.f("s.min_p").float()[:, None]
            probs = probs.masked_fill(probs < thresh, 0.0)
        if plan.any_top_p:  # rows at top_p 1 keep every nonzero entry
            probs = probs.masked_fill(~top_p_keep(probs, staged.f("s.top_p")), 0.0)
        u = staged.f("s.u").float()
        if plan.verifies:
            drafts, u_accept = staged.i("s.draft"), staged.f("s.u_accept").float()
            sampled = rejection_sample(probs, drafts, u_accept, u, draft_probs)
        else:
            sampled = inverse_cdf(probs, u)
        return torch.where(greedy_rows, greedy(logits), sampled)

    # -- one-call convenience (tests, benchmarks, code without a runner) --------------------

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        drafts: Sequence[int] | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> SampleResult:
        """Prepare, stage, sample and read back in one call (``logits``: ``[len(rows), vocab]``;
        ``drafts``, ``draft_probs``: as for :meth:`prepare` and :meth:`sample_staged`)."""
        staging = self._own_staging(logits.device)
        layout = StagingLayout()
        plan = self.prepare(rows, layout, drafts)
        tensors = self.sample_staged(logits, plan, staging.upload(layout), draft_probs)
        return unpack_samples(plan, staging.read(list(tensors)))

    def processed_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """``logits`` after penalties, min_tokens blocks, biases and grammar masks (what the
        draw sees)."""
        staging = self._own_staging(logits.device)
        layout = StagingLayout()
        plan = self.prepare(rows, layout)
        return self._processed(logits.float(), plan, staging.upload(layout))

    def _own_staging(self, device: torch.device) -> StagingBuffer:
        if self._staging is None or self._staging.device != device:
            self._staging = StagingBuffer(device)
        return self._staging


def drafts_before(
    rows: Sequence[SamplingRow], drafts: Sequence[int] | None
) -> list[list[int] | None]:
    """Per row, the drafted tokens that come before it in its request's verify rows (``[]``
    for the row of the request's last token), or None for a row that verifies nothing (a
    request that did not draft). A verify row's grammar mask, ``min_tokens`` block and
    penalty counts are those of the request's tokens followed by these drafts.

    ``drafts``: per row, the draft it verifies (``NO_DRAFT``: none); a request's ``1 + k``
    rows follow each other, so the drafts before row ``j`` are the ``drafts`` of its ``j``
    rows before."""
    n = len(rows)
    if drafts is None:
        return [None] * n
    out: list[list[int] | None] = []
    i = 0
    while i < n:
        j = i + 1
        while j < n and rows[j] is rows[i]:
            j += 1
        if j == i + 1 and drafts[i] == NO_DRAFT:
            out.append(None)
        else:
            out += [list(drafts[i:m]) for m in range(i, j)]
        i = j
    return out


#: How many host lists :class:`SampleTensors` reads back as.
SAMPLE_READS = len(SampleTensors._fields)


def unpack_samples(plan: SamplingPlan, host: Sequence[list[float]]) -> SampleResult:
    """Host lists read back from :class:`SampleTensors` (in field order) -> a :class:`SampleResult`."""
    tokens_f, chosen_lp, top_ids_f, top_lp, id_lp = host[:SAMPLE_READS]
    token_ids = [int(t) for t in tokens_f]
    logprobs: list[RowLogprobs | None] = [None] * plan.num_rows
    k_max = plan.k_max
    asked = unpadded(id_lp, plan.lp_ids)
    for j, (i, k) in enumerate(zip(plan.lp_rows, plan.lp_k)):
        ids = top_ids_f[j * k_max : j * k_max + k]
        vals = top_lp[j * k_max : j * k_max + k]
        logprobs[i] = (chosen_lp[j], [(int(t), v) for t, v in zip(ids, vals)], asked[j])
    return SampleResult(token_ids, logprobs)


def padded_ids(rows: Sequence[Sequence[int]]) -> list[int]:
    """Rows of token ids (each row's named tokens) as one flat list, every row padded with
    token 0 to the longest one's length: a ``[rows, width]`` gather's indices (the padding's
    logprobs are read by no one: :func:`unpadded`)."""
    width = max(map(len, rows), default=0)
    return [t for ids in rows for t in (*ids, *[0] * (width - len(ids)))]


def unpadded(flat: Sequence[float], rows: Sequence[Sequence[int]]) -> list[list[float]]:
    """The read-back values of a gather at :func:`padded_ids` ``(rows)``: each row's own."""
    width = max(map(len, rows), default=0)
    return [list(flat[r * width : r * width + len(ids)]) for r, ids in enumerate(rows)]


def prompt_logprob_reads(
    logits: torch.Tensor, targets: torch.Tensor, top_k: int, asked: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Prompt logprobs on the device, to read back: ``log_softmax(logits)[i, targets[i]]``
    for every row and its rank in the row's distribution (1 + the tokens strictly likelier:
    vLLM's ``rank``), then (``top_k`` > 0) each row's ``top_k`` likeliest logprobs and their
    token ids, then (``asked``, ``[rows, m]`` token ids) the logprobs of those tokens, from
    the same distribution (:func:`unpack_prompt_logprobs` reads them)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets.to(lp.device).view(-1, 1)).squeeze(1)
    places = (lp > chosen.unsqueeze(1)).sum(dim=1) + 1
    reads = [chosen, places]
    if top_k:
        top = lp.topk(top_k, dim=-1)
        reads += [top.values, top.indices]
    if asked is not None:
        reads.append(lp.gather(1, asked))
    return reads


def prompt_logprob_count(top_k: int, asked: bool = False) -> int:
    """How many tensors :func:`prompt_logprob_reads` returns."""
    return 2 + 2 * bool(top_k) + asked


def unpack_prompt_logprobs(
    host: Sequence[list[float]], top_k: int, asked: Sequence[Sequence[int]] = ()
) -> tuple[list[float], list[list[tuple[int, float]]], list[int], list[list[float]]]:
    """The host lists of :func:`prompt_logprob_reads`: each row's logprob, its
    ``(token_id, logprob)`` likeliest first (none when ``top_k`` is 0), its rank, and the
    logprobs of the tokens ``asked`` per row (none when nothing was asked)."""
    chosen, places = list(host[0]), [int(r) for r in host[1]]
    top: list[list[tuple[int, float]]] = []
    if top_k:
        values, ids = host[2], host[3]
        top = [
            [(int(t), v) for t, v in zip(ids[i : i + top_k], values[i : i + top_k])]
            for i in range(0, len(values), top_k)
        ]
    return chosen, top, places, unpadded(host[-1], asked) if asked else []
