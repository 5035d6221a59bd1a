"""The scheduler's side of speculative decoding: who drafts, how much, and what stood.

Each step, after the running requests' decodes are listed, every decoding request that may
draft asks the drafter (:mod:`radixserve.speculative`) for up to its adaptive ``k``
tokens (:class:`~radixserve.speculative.adaptive.AdaptiveK`); they go into ``req.drafts``
and :func:`~radixserve.scheduling.plan.plan_step` lays the request out as ``1 + k`` rows, each
sampling. When the step's tokens are read, :meth:`Speculation.verified` records how many
drafts stood (:func:`~radixserve.speculative.verify.accepted_length`); the scheduler appends
the accepted tokens one by one through its usual stop checks and frees the pages the
rejected drafts' KV took.

Who may draft: every greedy and sampled request whose last token is known on the host and
for which something drafts (the server's ``--speculative-algorithm``, or the request's own
prediction: :mod:`radixserve.speculative.prediction`, which needs no algorithm), while at
most ``speculative_disable_by_batch_size`` (8) requests are in the scheduler, running or
waiting (vLLM's flag and rule). Past that a step is compute-bound on the CPU and
a verify row costs about what a decode row does; and a step in which some request may draft
runs each request's rows on a kernel of their own (below), which a loaded step, holding
prefill chunks beside its decodes, pays for in weight reads. Counting the decodes of the
step alone was not enough: 16 chats at a time on shared system prompts spent their steps
between two waves with few decodes beside the next wave's prefill chunks, and were slower
than without speculation (benchmarks/agents.md).

Only a request that came to its first decode step under that load speculates (vLLM's flag
is for new requests too): one that began among more has decoded in batched steps, so there
is no output decoded alone for its verify rows to stay equal to, and it never makes a step
take the kernels named row by row (the last chats of a loaded run, left few, decode as
without speculation).

A sampled request's verify rows go through rejection sampling in the
sampler (:mod:`radixserve.speculative.rejection`): its output has the distribution of plain
sampling, though not the same draws for the same seed.

A request with a grammar drafts too: its draft is walked through its grammar matcher before
verification and cut at the first token the grammar forbids
(:meth:`~radixserve.constrained.matcher.GrammarMatcher.lookahead`, which keeps the mask
after each drafted token for the verify row that follows it and rolls the matcher back);
the scheduler then advances the matcher through the tokens that stood, one at a time.
Penalties and a pending ``min_tokens`` depend on the tokens before a row as well: the
sampler gives each verify row the counts (and the output length) of the request's tokens
followed by the drafts before it (:func:`~radixserve.engine.sampler.drafts_before`).

Exactness: every step holding a greedy decode that may draft (whether it drafted or not) names
each row's linear kernel (``plan.row_paths``; :meth:`Speculation.row_invariant`), so a
speculating request's rows always get the logits of the request decoded alone, one row per
step, and a prefill chunk in the same step the kernel of its own size.
"""

from __future__ import annotations

from radixserve.model.cpu_linear import GEMV_MAX_ROWS
from radixserve.scheduling.request import FUTURE_TOKEN, Request
from radixserve.scheduling.types import SchedulerCounters
from radixserve.speculative import AdaptiveK, Drafter, accepted_length, make_drafter
from radixserve.speculative.prediction import PredictionDrafter

__all__ = ["Speculation", "may_draft"]


def may_draft(req: Request) -> bool:
    """Whether ``req`` may draft this step: it speculates (``Speculation.decide``) and its last
    token is known on the host (the drafter reads it). Grammars, penalties and
    ``min_tokens`` are followed row by row (see above)."""
    return bool(req.speculates) and req.token_ids[-1] != FUTURE_TOKEN


class Speculation:
    """One scheduler's drafter and the per-request draft lengths."""

    def __init__(
        self,
        algorithm: str | None,
        k_max: int,
        counters: SchedulerCounters,
        drafter: Drafter | None = None,
        *,
        disable_by_batch_size: int,
    ) -> None:
        """``drafter``: one built by the caller (the ``draft`` model's); else the algorithm's
        (``None``: only requests with a prediction draft). A request's prediction comes
        first either way (:class:`~radixserve.speculative.prediction.PredictionDrafter`).
        ``disable_by_batch_size``: no drafting while more requests are running or waiting."""
        if drafter is None and algorithm is not None:
            drafter = make_drafter(algorithm)
        self.drafter = PredictionDrafter(drafter)
        self.k_max = k_max
        self.counters = counters
        self.disable_by_batch_size = disable_by_batch_size

    def on(self, load: int) -> bool:
        """Whether requests may draft in a step while ``load`` requests are running or waiting."""
        return load <= self.disable_by_batch_size

    # Rows up to which a prefill chunk runs the one-row kernel when alone (plan.row_paths).
    one_row_kernel_rows = GEMV_MAX_ROWS

    def decide(self, decodes: list[Request], load: int) -> None:
        """Settle, for each of ``decodes`` at its first decode step, whether it speculates: if
        ``load`` requests running or waiting allow it now, and anything drafts for it (the
        server's drafter, or its prediction)."""
        for req in decodes:
            if req.speculates is None:
                req.speculates = self.on(load) and self.drafter.drafts_for(req)

    def row_invariant(self, work: list[tuple[Request, int]], load: int) -> bool:
        """Whether this step's rows must each take their own kernel: some greedy decode in it
        may draft (its logits must be the one-row step's whether it drafted now or not; a
        sampled request's rejection sampling needs no such bits). ``load``: the requests
        running or waiting when the step was planned."""
        return self.on(load) and any(
            r.params.greedy and (r.drafts or may_draft(r))
            for r, n in work
            if n == 1 and r.num_pending == 1
        )

    def draft(self, decodes: list[Request], budget: int, step: int, load: int) -> int:
        """Fill ``req.drafts`` of the ``decodes`` that may draft, within ``budget`` tokens, while
        ``load`` requests are running or waiting; returns the tokens drafted."""
        if not self.on(load):
            return 0
        used = 0
        for req in decodes:
            if used >= budget or not may_draft(req):
                continue
            if req.spec is None:  # its first decode: the prompt is computed and cached
                req.spec = AdaptiveK(self.k_max)
                self.drafter.prompt_cached(req)
            remaining = min(
                req.params.max_tokens - req.num_output, req.max_total_len - len(req.token_ids)
            )
            k = min(req.spec.budget(step), budget - used, remaining - 1)
            if k > 0:
                req.drafts = self.drafter.propose(req, k)
                if req.grammar is not None and req.drafts:  # cut where the grammar says no
                    req.drafts = req.drafts[: req.grammar.lookahead(req.drafts)]
                used += len(req.drafts)
        return used

    def verified(self, req: Request, drafts: list[int], tokens: list[int]) -> int:
        """``req``'s ``drafts`` were verified against the model's ``tokens`` (one per row):
        record it; returns how many drafts stood."""
        accepted = accepted_length(drafts, tokens)
        req.spec_drafted += len(drafts)
        req.spec_accepted += accepted
        c = self.counters
        c.spec_verifies += 1
        c.spec_drafted_tokens += len(drafts)
        c.spec_accepted_tokens += accepted
        if req.spec is not None:
            req.spec.update(len(drafts), accepted, c.steps)
        return accepted

    def finished(self, req: Request) -> None:
        """``req`` left the scheduler (every path)."""
        self.drafter.finished(req)
        req.drafts = []
