"""Continuous batching over a paged KV cache with a radix prefix cache: the decisions.

The scheduler works on host lists only (requests, page ids, token counts); the model
runner owns the device. One step, as the engine drives it (nano-vllm's split)::

    batch = scheduler.schedule()        # decide; a ScheduledBatch holding a StepPlan (host lists)
    result = runner.execute(batch.plan) # one copy in, forward, sample, one read back
    outputs = scheduler.process(batch, result)    # = advance(batch) + resolve(batch, result)

Overlap scheduling splits :meth:`process` in two: :meth:`advance` right after the runner
launched a step (what is known before its results: computed lengths, cache inserts of
prefill chunks, one placeholder token per sampled request, which the next step's plan
names as "the token step N sampled" for the runner to fill in on the device), and
:meth:`resolve` once its results are read (tokens, logprobs, stop checks), which then
happens after the next step was planned and launched: stop checks are one step late, and
the token a finished request got in the step after is dropped. Pages given up while a step
is in flight (a finish, an abort, the cache's duplicate-page swap) are freed only when that
step has been resolved, i.e. after the last step that can read them has finished
(:class:`~radixserve.scheduling.references.KVReferences`).

:meth:`Scheduler.schedule`:

    1. running work      every running request gets its next tokens: decodes 1 each, then
                         chunked prefills (and recomputes after retraction) what the token
                         budget leaves. Their new pages are allocated (evicting LRU cache
                         leaves); if even that cannot cover them, the running request with the
                         least progress is retracted (refs released, requeued with its
                         output kept) until it can.
    2. admission         waiting requests in policy order (LPM with an aging bound, or FCFS)
                         through a :class:`~radixserve.scheduling.admission.PrefillAdder`.
    3. plan              one StepPlan for everything (mixed extend + decode): plan.plan_step.

:meth:`Scheduler.process`: chunks that were extends go into the cache (so others reuse them at
once); sampled tokens are appended; stop/length checks; finished requests insert prompt +
output into the cache and release every reference (stop, length, abort, error, retraction
all go through :meth:`_release`, which :mod:`~radixserve.scheduling.references` carries out).

The admission headroom's ``new_token_ratio`` (:class:`~radixserve.scheduling.admission.NewTokenRatio`)
decays while nothing is retracted and jumps back up when something is, so admission tracks
how long outputs really are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixserve.memory import PageAllocator, PrefixCache
from radixserve.scheduling.admission import AddResult, NewTokenRatio, PrefillAdder
from radixserve.scheduling.plan import PageTableRows, ScheduledBatch, StepResult, plan_step
from radixserve.scheduling.policy import count_bypasses, make_policy
from radixserve.scheduling.prefilled import Reservations
from radixserve.scheduling.references import KVReferences
from radixserve.scheduling.request import FUTURE_TOKEN, Request, RequestStatus
from radixserve.scheduling.sessions import turn_admitted, turn_ended
from radixserve.scheduling.speculation import Speculation
from radixserve.scheduling.types import (
    RequestOutput,
    RowLogprobs,
    SchedulerConfig,
    SchedulerCounters,
)
from radixserve.speculative import Drafter

logger = logging.getLogger(__name__)

__all__ = [
    "NeedsSync",
    "RequestOutput",
    "ScheduledBatch",
    "StepFailure",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerCounters",
    "StepResult",
]


class NeedsSync(Exception):
    """:meth:`Scheduler.schedule` cannot decide while a step is in flight (it would retract):
    resolve the step in flight, then schedule again."""


class StepFailure(RuntimeError):
    """Raised from inside a step's result handling (an ``on_finish`` hook: the prefill side's
    KV transfer found a tensor-parallel rank gone) when the step cannot complete. The step
    loop fails the step's requests, pages given back, as for a failed forward, then hands the
    error to its ``on_error``. The hook must raise it before it changes anything it owns."""


class Scheduler:
    """Owns the waiting and running requests; decides each step on host lists."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: PrefixCache,
        allocator: PageAllocator,
        eos_token_ids: tuple[int, ...] = (),
        drafter: Drafter | None = None,
    ) -> None:
        """``drafter``: speculative decoding's, when the engine builds it (a draft model)."""
        self.config = config
        self.cache = cache
        self.allocator = allocator
        self.eos_token_ids = frozenset(eos_token_ids)
        self.page_size = config.page_size
        self.policy = make_policy(
            config.schedule_policy, cache, config.lpm_max_bypass, config.lpm_max_queue
        )
        self.rows = PageTableRows(config.max_running_requests, self.max_pages_per_request)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()
        self.new_token_ratio = NewTokenRatio(config)  # the admission headroom's ratio
        self._pending: list[RequestOutput] = []
        self._arrivals = 0
        # Locks, private pages and rows of running requests; steps launched and resolved.
        self.kv = KVReferences(cache, allocator, self.rows, self.page_size)
        # Disaggregation: requests whose prompt another engine computes (decode side), and
        # a call made as any request finishes, before its pages are released (prefill side);
        # it may raise StepFailure (the step loop then fails the step's requests).
        self.prefilled = Reservations(cache, allocator, self.rows, self.page_size)
        self.on_finish: Callable[[Request, str], None] | None = None
        # Speculative decoding (scheduling.speculation): None when off.
        self.speculation: Speculation | None = None
        if config.speculative_algorithm is not None or config.predicted_outputs:
            self.speculation = Speculation(
                config.speculative_algorithm,
                config.speculative_num_tokens,
                self.counters,
                drafter,
                disable_by_batch_size=config.speculative_disable_by_batch_size,
            )

    def drop_speculation(self, why: str) -> None:
        """Draft nothing, predictions included (an algorithm is refused before this): ``why``
        verify rows could not be trusted to give the one-row decode's logits."""
        if self.speculation is not None:
            logger.info("predicted outputs go unused: %s", why)
        self.speculation = None

    # ------------------------------------------------------------------ public API

    def add(self, req: Request) -> None:
        """Queue a validated request (the engine checks params and lengths first)."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        req.arrival_step = self._arrivals
        self._arrivals += 1
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Finish a request now (``reason`` "abort", or "stop" for a stop string found
        outside). Its references are released and its final output comes with the next step.
        Returns False for an unknown or already finished id."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, reason)
        self._pending.append(req.take_output())
        return True

    def admit_prefilled(
        self,
        request_id: str,
        first_token: int,
        first_logprob: RowLogprobs | None = None,
    ) -> None:
        """A reserved request's prompt KV has landed (:mod:`.prefilled`): it runs from here,
        ``first_token`` (the prefill engine's) its first output, reported with the next step."""
        req = self.prefilled.admit(request_id)
        req.arrival_step = self._arrivals
        self._arrivals += 1
        self.requests[req.request_id] = req
        self.running.append(req)
        self.counters.prompt_tokens += req.prompt_len
        self.counters.cached_prompt_tokens += req.cached_tokens or 0
        turn_admitted(self.cache, req)
        self._take_token(req, first_token, first_logprob)
        self._pending.append(req.take_output())

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    @property
    def max_pages_per_request(self) -> int:
        """Width of the page table: the pages of the longest context a request may reach."""
        return -(-self.config.max_total_len // self.config.page_size)

    @property
    def _load(self) -> int:
        """Requests running or waiting (speculative decoding's batch size: admitting or
        retracting within a step's planning leaves it as it was)."""
        return len(self.running) + len(self.waiting)

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside a step (aborts, requests that can never fit)."""
        out, self._pending = self._pending, []
        return out

    def schedule(self) -> ScheduledBatch | None:
        """Decide this step's work (pages allocated, rows taken); None when there is none."""
        work = self._schedule()
        if not work:
            return None
        kernel_rows = 0
        if self.speculation is not None and self.speculation.row_invariant(work, self._load):
            kernel_rows = self.speculation.one_row_kernel_rows
        batch = plan_step(work, self.rows, self.page_size, kernel_rows)
        if self.kv.window is not None:
            batch.plan.window_writes = self.kv.window.take_writes()
        return batch

    def process(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """Apply what the runner computed for ``batch``; report every request that progressed."""
        self.advance(batch)
        return self.resolve(batch, result)

    @property
    def in_flight(self) -> bool:
        """Whether a launched step is not resolved yet."""
        return self.kv.in_flight

    def advance(self, batch: ScheduledBatch) -> None:
        """The runner launched ``batch``: account for what is known before its results."""
        self.kv.step_launched()
        self.counters.steps += 1
        self.counters.computed_tokens += batch.plan.num_tokens
        for req, lo, count in batch.prompt_spans:
            req.prompt_lp_next = lo + count
        for req, n in batch.work:
            req.computed_len += n
            if req.hidden_states is not None:  # this step computes them up to here
                req.hidden_next = max(req.hidden_next, req.computed_len)
            if n > 1:
                self.kv.cache_computed(req)
            self.kv.release_window(req)
        for j, req in enumerate(batch.plan.sample_rows):
            if req.drafts and req.token_ids[-1] == FUTURE_TOKEN:
                continue  # a verify row after the request's first: one placeholder for them all
            req.token_ids.append(
                FUTURE_TOKEN
            )  # the token this step samples, filled in by resolve()
            req.future_index = j
            if req.num_output >= req.params.max_tokens or len(req.token_ids) >= req.max_total_len:
                req.finishing = True  # a length stop, known now: no further step for it

    def resolve(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """``batch``'s results are read: tokens in, stop checks, pages of finished requests back."""
        self.kv.step_resolved()
        return self._process(batch, result)

    def fail(
        self, batch: ScheduledBatch, error: BaseException, advanced: bool = False
    ) -> list[RequestOutput]:
        """The runner failed on ``batch`` (``advanced``: after :meth:`advance`, i.e. while reading
        its results): finish its requests with an error, pages given back."""
        if advanced:
            self.kv.step_resolved()
        outputs = []
        for req, _ in batch.work:
            if req.status is RequestStatus.RUNNING:
                if req.token_ids[-1] == FUTURE_TOKEN:
                    req.end_at(len(req.token_ids) - 2)
                self._finish(req, "error", f"{type(error).__name__}: {error}")
                outputs.append(req.take_output())
        self.kv.free_deferred()
        return outputs

    def flush_cache(self, waiting_ok: bool = False) -> bool:
        """Drop every cached prefix; only when idle (returns False otherwise), a step in
        flight included. ``waiting_ok``: waiting requests do not count (they hold no KV of
        the target model; new weights' requests recompute over theirs). The drafter's own
        cache goes only with nothing waiting: a retracted request may still hold draft KV,
        which new target weights leave valid."""
        if self.running or self.in_flight or (self.waiting and not waiting_ok):
            return False
        self.cache.reset()
        if self.speculation is not None and not self.waiting:
            self.speculation.drafter.reset()
        return True

    def retract_all(self) -> int:
        """Send every running request back to the queue, its computed KV cached in the tree
        and recomputed from there when it runs again (SGLang's ``pause_generation`` with
        mode ``retract``); returns how many. Not an admission misjudgment: the admission
        headroom stays as it was. Raises :class:`NeedsSync` while a step is in flight."""
        if self.in_flight:
            raise NeedsSync
        running = sorted(self.running, key=lambda r: r.arrival_step)
        for req in running:
            self._requeue(req)
        return len(running)

    def private_pages(self) -> list[int]:
        """Pages running requests hold outside the tree, and pages waiting for a step in flight."""
        return self.kv.private_pages(self.running) + self.prefilled.pages()

    def check_invariants(self) -> None:
        """Every page accounted for exactly once; every request's KV state consistent.

        (The runner's device page table is checked against ``running`` by the engine.)"""
        ps = self.page_size
        for r in self.running:
            assert r.status is RequestStatus.RUNNING, r
            assert len(r.pages) == -(-r.computed_len // ps), (
                f"pages do not cover computed tokens exactly: {r}"
            )
            assert r.cached_len % ps == 0 and r.cached_len <= r.computed_len, r
            assert r.lock_node is not None, r
            assert r.lock_node.depth == r.cached_len, (
                f"lock node depth {r.lock_node.depth} != cached_len: {r}"
            )
            assert 1 <= r.num_pending, r
        for r in self.waiting:
            assert (
                r.status is RequestStatus.WAITING
                and not r.pages
                and r.lock_node is None
                and r.slot < 0
            ), r
        assert len(self.requests) == len(self.running) + len(self.waiting)
        assert self.rows.num_free_rows == self.config.max_running_requests - len(
            self.running
        ) - len(self.prefilled)
        self.cache.check_invariants(self.private_pages())
        if self.speculation is not None:
            self.speculation.drafter.check_invariants(self.requests)

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> list[tuple[Request, int]]:
        self.cache.pins.expire()
        self.cache.leases.expire()
        work, budget = self._plan_running()
        if budget > 0 and self.waiting and self.rows.num_free_rows > 0:
            work += self._admit(budget, work)
        return work

    def _plan_running(self) -> tuple[list[tuple[Request, int]], int]:
        """Work for the running requests this step, with pages allocated (retracting if needed)."""
        ps = self.page_size
        retracted = False
        drafting = self.speculation is not None
        while True:
            budget = self.config.max_num_tokens
            work: list[tuple[Request, int]] = []
            for r in self.running:  # decodes first: they are what users are waiting on
                r.drafts = []
                if budget and r.num_pending == 1 and not r.finishing:
                    work.append((r, 1))
                    budget -= 1
            if self.speculation is not None:  # then their drafts (speculative decoding)
                decodes = [r for r, _ in work]
                self.speculation.decide(decodes, self._load)
                if drafting:
                    steps = self.counters.steps
                    budget -= self.speculation.draft(decodes, budget, steps, self._load)
            for r in self.running:
                if budget and r.num_pending > 1 and not r.finishing:
                    n = min(r.num_pending, budget)
                    work.append((r, n))
                    budget -= n
            needs = [-(-(r.computed_len + n + len(r.drafts)) // ps) - len(r.pages) for r, n in work]
            total = sum(needs)
            if total == 0 or self.allocator.can_alloc(total):
                break
            if drafting:  # short of pages: drop the drafts before retracting anyone
                drafting = False
                continue
            if self.in_flight:
                # Retracting now would free pages the step in flight reads (and its results
                # are not in yet): the caller resolves it first.
                raise NeedsSync
            if len(self.running) == 1:
                # Alone and still short: only possible if the pool cannot hold it at all.
                (r,) = self.running
                self._finish(
                    r, "error", "request does not fit in the KV pool even after evicting everything"
                )
                self._pending.append(r.take_output())
                return [], self.config.max_num_tokens
            victim = min(self.running, key=lambda r: (r.num_output, -r.arrival_step))
            self._retract(victim)
            retracted = True
        if not retracted:
            self.new_token_ratio.decay()
        if total:
            pages = self.allocator.alloc(total)
            i = 0
            for (r, _), k in zip(work, needs):
                if k:
                    self.rows.append(r.slot, len(r.pages), pages[i : i + k])
                    r.pages += pages[i : i + k]
                    i += k
        return work, budget

    def _admit(self, budget: int, work: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        cfg = self.config
        adder = PrefillAdder(
            cache=self.cache,
            allocator=self.allocator,
            rows=self.rows,
            page_size=self.page_size,
            token_budget=budget,
            free_slots=self.rows.num_free_rows,  # reservations hold rows too
            running=self.running,
            inflight=[r for r, n in work if n > 1 or r.num_pending > n],
            expected_len=self.new_token_ratio.expected_len,
            defer_tokens=cfg.defer_shared_prefix_tokens,
        )
        for req in self.policy.order(self.waiting, self.counters.steps):
            result = adder.add(req)
            if result is AddResult.STOP:
                break
            if result is AddResult.ADDED:
                self.waiting.remove(req)
                self.running.append(req)
                if req.cached_tokens is None:
                    req.cached_tokens = min(req.cached_len, req.prompt_len)
                    self.counters.prompt_tokens += req.prompt_len
                    self.counters.cached_prompt_tokens += req.cached_tokens
                    turn_admitted(self.cache, req)
        count_bypasses(self.waiting, [r for r, _ in adder.admitted])
        return adder.admitted

    # ------------------------------------------------------------------ results

    def _process(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        self.kv.free_deferred()
        prompt_lps, prompt_top = result.prompt_logprobs, result.prompt_top
        i = 0
        for req, _, count in batch.prompt_spans:
            assert req.prompt_logprobs is not None
            if req.status is RequestStatus.RUNNING:
                req.prompt_logprobs.extend(prompt_lps[i : i + count])
                assert req.prompt_logprob_ranks is not None
                req.prompt_logprob_ranks.extend(result.prompt_ranks[i : i + count])
                if req.prompt_top_logprobs is not None:  # its own k of the step's most
                    k = req.params.prompt_top_k
                    req.prompt_top_logprobs.extend(top[:k] for top in prompt_top[i : i + count])
                if req.prompt_asked_logprobs is not None:
                    req.prompt_asked_logprobs.extend(result.prompt_asked[i : i + count])
            i += count
        for req, embedding in zip(batch.plan.embed_reqs, result.embeddings):
            req.embedding = embedding  # goes out with the token this step sampled for it
        _take_hidden(batch, result)
        outputs: list[RequestOutput] = []
        tokens, logprobs = result.token_ids, result.logprobs
        if batch.drafted is None:  # one row per sampled request
            for req, tok, lp in zip(batch.plan.sample_rows, tokens, logprobs):
                if req.status is not RequestStatus.RUNNING:
                    continue  # finished (or aborted) while this step ran: its token is dropped
                self._take_token(req, tok, lp)
                outputs.append(req.take_output())
            return outputs
        i = 0
        for req, drafts in batch.drafted:  # 1 + len(drafts) rows each
            rows = slice(i, i + 1 + len(drafts))
            i = rows.stop
            if req.status is not RequestStatus.RUNNING:
                continue
            outputs.append(self._take_verified(req, drafts, tokens[rows], logprobs[rows]))
            if req.hidden_states is not None:  # a rejected draft's row is no position of it
                del req.hidden_states[req.computed_len :]
                req.hidden_next = len(req.hidden_states)
        return outputs

    def _take_token(self, req: Request, tok: int, lp: RowLogprobs | None) -> bool:
        """``tok`` fills ``req``'s placeholder; stop checks. Returns whether it goes on."""
        pos = req.fill_placeholder(tok, lp)
        self.counters.generated_tokens += 1
        if req.grammar is not None and not req.grammar.accept(tok):
            # The mask makes a token the grammar refuses unreachable; a grammar too costly
            # to follow says so.
            failure = req.grammar.failure
            req.end_at(pos)
            self._finish(
                req, "error", failure or f"sampled token {tok} is not allowed by its grammar"
            )
            if failure is not None:
                req.error_code = "invalid_params"  # the request's grammar, not the engine
            return False
        reason = req.stop_reason(tok, pos + 1, self.eos_token_ids)
        if reason is not None:
            req.end_at(pos)
            self._finish(req, reason)
            return False
        return True

    def _take_verified(
        self,
        req: Request,
        drafts: list[int],
        tokens: list[int],
        logprobs: list[RowLogprobs | None],
    ) -> RequestOutput:
        """A request's verify rows are read: the model's token after its last token, then,
        for each draft that stood, the model's token after it (each through the stop checks,
        so a stop or ``max_tokens`` inside the drafts ends it there); the pages that only the
        rejected drafts' KV used are freed now."""
        req.drafts = []
        n = 1
        if drafts:
            assert self.speculation is not None
            n += self.speculation.verified(req, drafts, tokens)
        for j in range(n):
            if j:  # draft j stood: its KV (computed this step) is the token's, the next follows
                req.computed_len += 1
                req.token_ids.append(FUTURE_TOKEN)
            if not self._take_token(req, tokens[j], logprobs[j]):
                return req.take_output()
        keep = -(-req.computed_len // self.page_size)
        if len(req.pages) > keep:  # pages only rejected drafts wrote to
            self.kv.free_pages(req.pages[keep:])
            req.pages = req.pages[:keep]
        return req.take_output()

    # ------------------------------------------------------------------ leaving the running set

    def _release(self, req: Request) -> None:
        """Give back every reference ``req`` holds (:meth:`KVReferences.release`); it leaves
        the running set."""
        if req.status is not RequestStatus.RUNNING:
            return
        self.kv.release(req)
        self.running.remove(req)

    def _retract(self, req: Request) -> None:
        """Send a running request back to the queue for want of pages (admission was too
        optimistic: its headroom goes up)."""
        self._requeue(req)
        self.new_token_ratio.bump()

    def _requeue(self, req: Request) -> None:
        """Send a running request back to the queue; it keeps its output and is recomputed later."""
        logger.debug("retracting %s", req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.counters.retractions += 1
        self.waiting.append(req)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if self.on_finish is not None:
            self.on_finish(req, reason)
        if self.speculation is not None:
            self.speculation.finished(req)
        if req.status is RequestStatus.RUNNING:
            turn_ended(self.cache, self.kv, req, reason)  # its path leased to its session
            self._release(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        if req.params.pin_ttl_s is not None and reason in ("stop", "length"):
            self.cache.pins.pin(
                req.token_ids[: req.prompt_len], req.namespace, req.params.pin_ttl_s
            )
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        self.requests.pop(req.request_id, None)
        if reason == "abort":
            self.counters.aborted += 1
        else:
            self.counters.finished += 1


def _take_hidden(batch: ScheduledBatch, result: StepResult) -> None:
    """Each running request's hidden states of ``batch`` (params.return_hidden_states), in
    position order; a request that finished while the step ran takes none."""
    i = 0
    for req, count in batch.plan.hidden_spans:
        if req.status is RequestStatus.RUNNING and req.hidden_states is not None:
            req.hidden_states.extend(result.hidden_states[i : i + count])
        i += count
