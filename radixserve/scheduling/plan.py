"""The scheduler's description of one step: host lists only, handed to the model runner.

The scheduler decides *what* runs (request, number of new tokens); :func:`plan_step` lays it
out as a :class:`StepPlan` of plain lists, which the runner packs into one host-to-device
copy::

    work:        (req0, 5)            (req1, 1)  (req2, 1)  (req3, 3)
    rows (T):    0 1 2 3 4            5          6          7 8 9
    positions:   c0 .. c0+4           c1         c2         c3 .. c3+2
    out_slots:   pages[pos // page_size] * page_size + pos % page_size   (from the host page lists)

``logits_indices`` lists the rows whose logits are needed: first the last row of every
request whose tokens are now all computed (it samples), then the prompt rows whose
logprobs were asked for, then the other rows whose hidden states were asked for
(``params.return_hidden_states``: the final norm runs on logits rows only; their logits are
computed and dropped, which keeps every tensor-parallel rank's forward the same)::

    logits rows: [ sample rows | prompt-logprob rows | hidden-only rows ]
    hidden_rows: per request of hidden_spans, its positions in order (indices into the above)

A decode that drafted ``k`` tokens (speculative decoding, ``req.drafts``) is laid out as
``1 + k`` rows, its last token and the drafts, and every one of them samples (the request
appears ``1 + k`` times in ``sample_rows``). While requests speculate, a plan names the
linear kernel of every row (``row_paths``): each request's rows take the kernel they would
take if it ran alone (decode and verify rows the one-row kernel, a prefill chunk the kernel
of its size), so no row's logits depend on the rows around it and each verify row's are
those a one-row decode step of the same position would get::

    work:        (req0, 1) with drafts d1 d2      (req1, 1)
    rows:        0 1 2                            3
    input_ids:   t0 d1 d2                         t1
    sample rows: 0 1 2                            3

:class:`PageTableRows` is the host side of the runner's persistent device page table
(``[max_running, max_pages]``, one row per running request): the scheduler acquires and
releases rows and records the entries that changed; each plan carries the changes since
the last one, so the device table is patched, never rebuilt and never read back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from radixserve.scheduling.request import FUTURE_TOKEN, Request
from radixserve.scheduling.types import RowLogprobs
from radixserve.speculative.verify import NO_DRAFT


class PageTableRows:
    """Rows of the device page table (host bookkeeping) and the entries not yet sent."""

    def __init__(self, max_rows: int, max_pages: int) -> None:
        self.max_rows = max_rows
        self.max_pages = max(1, max_pages)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._pages: list[int] = []

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def acquire(self) -> int:
        return self._free_rows.pop()

    def release(self, row: int) -> None:
        self._free_rows.append(row)

    def set_row(self, row: int, pages: list[int]) -> None:
        """Rewrite a row from column 0 (admission, or after the cache swapped duplicate pages)."""
        self.append(row, 0, pages)

    def append(self, row: int, col: int, pages: list[int]) -> None:
        """Record ``pages`` written at ``row``, columns ``col..`` (sent with the next plan)."""
        k = len(pages)
        self._rows += [row] * k
        self._cols += range(col, col + k)
        self._pages += pages

    def pending(self) -> list[tuple[int, int, int]]:
        """The entries not yet taken, as (row, col, page) (invariant checks)."""
        return list(zip(self._rows, self._cols, self._pages))

    def take_writes(self) -> tuple[list[int], list[int], list[int]]:
        """The entries recorded since the last call: (rows, cols, pages)."""
        out = (self._rows, self._cols, self._pages)
        self._rows, self._cols, self._pages = [], [], []
        return out


@dataclass
class StepPlan:
    """Everything the runner needs for one forward and its sampling, as host lists.

    Sequence ``b`` computes ``extend_lens[b]`` new tokens after ``prefix_lens[b]`` cached
    ones; its pages are ``page_lists[b]`` (the attention metadata reads these, never the
    device table) and its page-table row is ``table_rows[b]``.
    """

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    out_slots: list[int]  # [T] KV slot of each new row
    table_rows: list[int]  # [B]
    prefix_lens: list[int]  # [B]
    extend_lens: list[int]  # [B]
    seq_lens: list[int]  # [B]
    page_lists: list[list[int]]  # [B] each sequence's pages (at least enough for seq_lens[b])
    write_rows: list[int]  # page-table entries changed since the last plan
    write_cols: list[int]
    write_pages: list[int]
    logits_indices: list[int]  # sample rows first, then prompt-logprob rows
    sample_rows: list[Request]  # logits[i] samples sample_rows[i]
    prompt_targets: list[int]  # the token each prompt-logprob row scores
    # Overlap scheduling: rows whose input token the previous step samples (not known on the
    # host yet; the runner takes it from that step's device output), and its row there.
    future_rows: list[int]
    future_src: list[int]
    # Speculative decoding: the rows whose linears run the one-row kernel (cpu_gemv) and
    # those that run oneDNN, whatever the step's row count (model.cpu_linear.
    # RowInvariantLinears); None: the row count decides, as usual.
    row_paths: tuple[list[int], list[int]] | None = None
    # Speculative decoding: per sample row, the drafted token it verifies (NO_DRAFT: none;
    # a sampled request's rows go through rejection sampling); None: no row verifies one.
    sample_drafts: list[int] | None = None
    # A sliding-window model's window pool (memory.window_pool): the global-page -> window-page
    # map entries changed since the last plan (window page -1: none any more).
    window_writes: tuple[list[int], list[int]] | None = None
    # How many of the likeliest tokens each prompt-logprob row also reports (the most any of
    # its requests asks for: their ``params.prompt_top_k``; 0: the scored token's logprob
    # and rank only).
    prompt_top_k: int = 0
    # Per prompt-logprob row, the tokens whose logprobs its request also asks for
    # (``params.logprob_token_ids``; empty: none); all empty when no request asks.
    prompt_asked: list[list[int]] = field(default_factory=list)
    # LoRA adapters (model.lora): each sequence's adapter slot (0: the base model); None:
    # every sequence is the base model's.
    lora_slots: list[int] | None = None
    # Embeddings (params.return_embedding): the sample rows (indices into ``sample_rows``)
    # that are a prompt's last row, whose final-norm output is read back, and their requests.
    embed_rows: list[int] = field(default_factory=list)
    embed_reqs: list[Request] = field(default_factory=list)
    # Hidden states (params.return_hidden_states): the logits rows whose final-norm output
    # is read back, and per request (request, its rows' count) in the same order.
    hidden_rows: list[int] = field(default_factory=list)
    hidden_spans: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode_only(self) -> bool:
        return len(self.input_ids) == len(self.seq_lens)


class ScheduledBatch(NamedTuple):
    """One step as the scheduler keeps it: the work, the plan, and how to read the results."""

    work: list[tuple[Request, int]]
    plan: StepPlan
    # Prompt logprobs: (request, first position, count); their values follow in order.
    prompt_spans: list[tuple[Request, int, int]]
    # Speculative decoding: each sampled request with the drafts it verifies (its rows in
    # ``plan.sample_rows`` follow in order, ``1 + len(drafts)`` of them); None: no drafts.
    drafted: list[tuple[Request, list[int]]] | None = None

    def needs_results(self) -> bool:
        """Whether planning the next step needs this step's tokens on the host: grammar masks,
        penalties and bad-word bans are computed from a request's tokens so far, and how many
        drafts stood decides the next step's rows."""
        if self.drafted is not None:
            return True
        for r in self.plan.sample_rows:
            p = r.params
            if (
                r.grammar is not None
                or p.repetition_penalty != 1.0
                or p.frequency_penalty
                or p.presence_penalty
                or p.bad_words_token_ids
            ):
                return True
        return False


def plan_step(
    work: list[tuple[Request, int]],
    rows: PageTableRows,
    page_size: int,
    one_row_kernel_rows: int = 0,
) -> ScheduledBatch:
    """Lay out ``work`` (request, new tokens) as one flattened step. ``one_row_kernel_rows``
    (speculative decoding): name each row's linear kernel (``row_paths``), a chunk of up to
    this many rows and every decode and verify row taking the one-row kernel (0: do not)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    table_rows: list[int] = []
    prefix_lens: list[int] = []
    ext_lens: list[int] = []
    seq_lens: list[int] = []
    page_lists: list[list[int]] = []
    sample_rows: list[int] = []
    sample_reqs: list[Request] = []
    lp, hid = _PromptRows(), _HiddenRows()
    embed_rows: list[int] = []
    embed_reqs: list[Request] = []
    future_rows: list[int] = []
    future_src: list[int] = []
    drafted: list[tuple[Request, list[int]]] = []
    verified: list[int] = []
    gemv_rows: list[int] = []
    onednn_rows: list[int] = []
    ps = page_size
    t = 0
    for req, n in work:
        c = req.computed_len
        pages = req.pages
        # list slicing / range run in C; slots of a decode row are one expression
        input_ids += req.token_ids[c : c + n]
        if input_ids[-1] == FUTURE_TOKEN:  # only a decode's one token can be in flight
            future_rows.append(t + n - 1)
            future_src.append(req.future_index)
            input_ids[-1] = 0
        input_ids += req.drafts  # a decode's drafts (speculative decoding) follow its token
        m = n + len(req.drafts)  # rows
        if one_row_kernel_rows:  # the kernel its rows would run alone
            (gemv_rows if n <= one_row_kernel_rows else onednn_rows).extend(range(t, t + m))
        positions += range(c, c + m)
        if m == 1:
            slots.append(pages[c // ps] * ps + c % ps)
        else:
            slots += [pages[p // ps] * ps + p % ps for p in range(c, c + m)]
        table_rows.append(req.slot)
        prefix_lens.append(c)
        ext_lens.append(m)
        seq_lens.append(c + m)
        page_lists.append(pages[: -(-(c + m) // ps)])
        hid.add(req, c, m, t, len(sample_rows) if c + n == len(req.token_ids) else -1)
        if c + n == len(req.token_ids):  # every verify row samples
            if c + n == req.prompt_len and req.wants_embedding:  # the prompt's last row
                embed_rows.append(len(sample_rows))
                embed_reqs.append(req)
            sample_rows += range(t + n - 1, t + m)
            sample_reqs += [req] * (m - n + 1)
            drafted.append((req, req.drafts))
            verified += req.drafts + [NO_DRAFT]  # row i verifies draft i; the last, none
        lp.add(req, c, n, t)
        t += m
    w_rows, w_cols, w_pages = rows.take_writes()
    plan = StepPlan(
        input_ids=input_ids,
        positions=positions,
        out_slots=slots,
        table_rows=table_rows,
        prefix_lens=prefix_lens,
        extend_lens=ext_lens,
        seq_lens=seq_lens,
        page_lists=page_lists,
        write_rows=w_rows,
        write_cols=w_cols,
        write_pages=w_pages,
        logits_indices=sample_rows + lp.rows + hid.extra,
        sample_rows=sample_reqs,
        prompt_targets=lp.targets,
        future_rows=future_rows,
        future_src=future_src,
        row_paths=(gemv_rows, onednn_rows) if one_row_kernel_rows else None,
        prompt_top_k=lp.top_k,
        prompt_asked=lp.asked if any(lp.asked) else [],
        lora_slots=_lora_slots(work),
        embed_rows=embed_rows,
        embed_reqs=embed_reqs,
        hidden_rows=hid.logits_rows(len(sample_rows) + len(lp.rows)),
        hidden_spans=hid.spans,
    )
    verifies = len(sample_reqs) > len(drafted)  # some request drafted
    if verifies:
        plan.sample_drafts = verified
    return ScheduledBatch(work, plan, lp.spans, drafted if verifies else None)


@dataclass
class _PromptRows:
    """The prompt-logprob rows of a step being laid out: their rows, the tokens they score,
    the most likeliest tokens any asks for, the tokens each row's request names, and per
    request its (first position, count)."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    top_k: int = 0
    asked: list[list[int]] = field(default_factory=list)
    spans: list[tuple[Request, int, int]] = field(default_factory=list)

    def add(self, req: Request, c: int, n: int, t: int) -> None:
        """``req``'s positions ``c .. c + n`` (rows from ``t``) whose logits it still needs."""
        if not req.wants_prompt_logprobs:
            return
        lo, hi = max(c, req.prompt_lp_next), min(c + n, req.prompt_len - 1)
        if hi > lo:
            self.rows += range(t + lo - c, t + hi - c)
            self.targets += req.token_ids[lo + 1 : hi + 1]
            self.top_k = max(self.top_k, req.params.prompt_top_k)
            self.asked += [req.params.logprob_token_ids or []] * (hi - lo)
            self.spans.append((req, lo, hi - lo))


@dataclass
class _HiddenRows:
    """The hidden-state rows of a step being laid out: rows that are not sample rows
    (``extra``, logits rows after the prompt-logprob rows), each request's rows in position
    order (a sample row as its index there, an extra row as ``-1 - its index in extra``), and
    per request its count."""

    extra: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    spans: list[tuple[Request, int]] = field(default_factory=list)

    def add(self, req: Request, c: int, m: int, t: int, first_sample: int) -> None:
        """``req``'s rows ``t ..`` (positions ``c .. c + m``) whose hidden states it still
        needs; ``first_sample``: the sample index of its first sampling row (a sampling
        request's last ``1 + len(req.drafts)`` rows sample), -1 when none samples."""
        if req.hidden_states is None:
            return
        lo = max(c, req.hidden_next)
        plain_hi = c + m - (0 if first_sample < 0 else 1 + len(req.drafts))
        if plain_hi > lo:  # positions before the sampling rows: extra logits rows
            base = len(self.extra)
            self.rows += range(-1 - base, -1 - base - (plain_hi - lo), -1)
            self.extra += range(t + lo - c, t + plain_hi - c)
        first = max(lo, plain_hi)
        self.rows += range(first_sample + first - plain_hi, first_sample + c + m - plain_hi)
        if c + m > lo:
            self.spans.append((req, c + m - lo))

    def logits_rows(self, extra_at: int) -> list[int]:
        """Each row's index among the logits rows, the extra rows starting at ``extra_at``."""
        return [r if r >= 0 else extra_at - 1 - r for r in self.rows]


def _lora_slots(work: list[tuple[Request, int]]) -> list[int] | None:
    """Each sequence's LoRA adapter slot, None where every one is the base model's."""
    slots = [req.lora_slot for req, _ in work]
    return slots if any(slots) else None


class StepResult(NamedTuple):
    """What the runner read back for one plan (host values only)."""

    token_ids: list[int]  # one per plan.sample_rows
    # Per sampled row: (logprob, [(token_id, logprob), ...]) or None when it did not ask.
    logprobs: list[RowLogprobs | None]
    prompt_logprobs: list[float]  # one per plan.prompt_targets
    # One per plan.prompt_targets when plan.prompt_top_k: the likeliest (token, logprob)s.
    prompt_top: list[list[tuple[int, float]]] = []
    # One per plan.prompt_targets: the scored token's rank (1: the likeliest).
    prompt_ranks: list[int] = []
    # One per plan.prompt_targets when plan.prompt_asked: the asked-for tokens' logprobs.
    prompt_asked: list[list[float]] = []
    # One per plan.embed_reqs: the final norm's output at the prompt's last row.
    embeddings: list[list[float]] = []
    # One per plan.hidden_rows: the final norm's output there.
    hidden_states: list[list[float]] = []
