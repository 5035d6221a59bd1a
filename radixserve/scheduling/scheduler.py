"""Continuous batching over a paged KV cache with a radix prefix cache.

One :meth:`Scheduler.step`::

    1. running work      every running request gets its next tokens: decodes 1 each, then
                         chunked prefills (and recomputes after retraction) what the token
                         budget leaves. Their new pages are allocated (evicting LRU cache
                         leaves); if even that cannot cover them, the running request with the
                         least progress is retracted (refs released, requeued with its
                         output kept) until it can.
    2. admission         waiting requests in policy order (LPM with an aging bound, or FCFS):
                         match the prompt in the radix cache, lock the hit, allocate pages for
                         the first chunk, while budget, request slots and KV headroom last.
                         A request whose uncached prefix is being computed by another request
                         right now waits for it to land in the cache instead of computing it
                         again.
    3. forward           one ForwardBatch for everything (mixed extend + decode).
    4. results           chunks that were extends go into the cache (so others reuse them at
                         once); finished prompts sample a token; stop/length checks; finished
                         requests insert prompt + output into the cache and release every
                         reference (stop, length, abort, error, retraction all go through
                         :meth:`_release`).

Memory headroom at admission follows SGLang: each running request reserves pages for
``new_token_ratio`` of its remaining ``max_tokens``; the ratio decays while nothing is
retracted and jumps back up when something is, so admission tracks how long outputs
really are.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from radixserve.memory.allocator import OutOfPagesError, PageAllocator
from radixserve.memory.radix_cache import RadixCache
from radixserve.model.forward_batch import ForwardBatch
from radixserve.scheduling.batch import LogitsPlan, PageTable, build_forward_batch
from radixserve.scheduling.policy import make_policy
from radixserve.scheduling.request import Request, RequestStatus
from radixserve.scheduling.sampler import Sampler, token_logprobs
from radixserve.scheduling.types import RequestOutput, SchedulerConfig, SchedulerCounters

logger = logging.getLogger(__name__)

ForwardFn = Callable[[ForwardBatch], torch.Tensor]

__all__ = ["RequestOutput", "Scheduler", "SchedulerConfig", "SchedulerCounters"]


class Scheduler:
    """Owns the waiting and running requests and drives one model forward per step."""

    def __init__(
        self,
        config: SchedulerConfig,
        forward: ForwardFn,
        cache: RadixCache,
        allocator: PageAllocator,
        sampler: Sampler,
        eos_token_ids: tuple[int, ...] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.forward = forward
        self.cache = cache
        self.allocator = allocator
        self.sampler = sampler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = torch.device(device)
        self.page_size = config.page_size
        self.policy = make_policy(config.schedule_policy, cache, config.lpm_max_bypass, config.lpm_max_queue)
        max_pages = -(-config.max_total_len // config.page_size)
        self.page_table = PageTable(config.max_running_requests, max_pages, self.device)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()
        self.new_token_ratio = config.init_new_token_ratio
        self._pending: list[RequestOutput] = []
        self._arrivals = 0

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
        self._pending.append(self._output(req))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and report every request that progressed."""
        outputs, self._pending = self._pending, []
        work = self._schedule()
        if not work:
            return outputs
        try:  # building the batch can fail too (device memory, a device error surfacing)
            fb, plan = build_forward_batch(work, self.page_table, self.page_size, self.device)
            with torch.inference_mode():
                logits = self.forward(fb)
                sampled = self.sampler.sample(logits[: len(plan.sample_reqs)], plan.sample_reqs) if plan.sample_reqs else None
                prompt_lps = (
                    token_logprobs(logits[len(plan.sample_reqs) :], plan.prompt_targets) if plan.prompt_spans else []
                )
        except Exception as e:  # a failed forward must not leak the batch's pages
            logger.exception("forward failed; finishing %d requests with an error", len(work))
            for req, _ in work:
                self._finish(req, "error", f"{type(e).__name__}: {e}")
                outputs.append(self._output(req))
            return outputs
        self.counters.steps += 1
        self.counters.computed_tokens += fb.num_tokens
        outputs.extend(self._process(work, plan, sampled, prompt_lps))
        return outputs

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only when idle (returns False otherwise)."""
        if self.running or self.waiting:
            return False
        self.cache.reset()
        return True

    def private_pages(self) -> list[int]:
        """Pages running requests hold outside the tree."""
        ps = self.page_size
        return [p for r in self.running for p in r.pages[r.cached_len // ps :]]

    def check_invariants(self) -> None:
        """Every page accounted for exactly once; every request's KV state consistent."""
        ps = self.page_size
        self.page_table.flush()
        for r in self.running:
            assert r.status is RequestStatus.RUNNING, r
            assert len(r.pages) == -(-r.computed_len // ps), f"pages do not cover computed tokens exactly: {r}"
            assert r.cached_len % ps == 0 and r.cached_len <= r.computed_len, r
            assert r.lock_node is not None, r
            if not self.cache.disabled:
                assert r.lock_node.depth == r.cached_len, f"lock node depth {r.lock_node.depth} != cached_len: {r}"
            assert 1 <= r.num_pending, r
            assert self.page_table.row_matches(r.slot, r.pages), f"page table row out of date: {r}"
        for r in self.waiting:
            assert r.status is RequestStatus.WAITING and not r.pages and r.lock_node is None and r.slot < 0, r
        assert len(self.requests) == len(self.running) + len(self.waiting)
        assert self.page_table.num_free_rows == self.config.max_running_requests - len(self.running)
        self.cache.check_invariants(self.private_pages())

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> list[tuple[Request, int]]:
        self.cache.pins.expire()
        work, budget = self._plan_running()
        if budget > 0 and self.waiting and len(self.running) < self.config.max_running_requests:
            work += self._admit(budget, work)
        return work

    def _plan_running(self) -> tuple[list[tuple[Request, int]], int]:
        """Work for the running requests this step, with pages allocated (retracting if needed)."""
        ps = self.page_size
        retracted = False
        while True:
            budget = self.config.max_num_tokens
            work: list[tuple[Request, int]] = []
            for r in self.running:  # decodes first: they are what users are waiting on
                if budget and r.num_pending == 1:
                    work.append((r, 1))
                    budget -= 1
            for r in self.running:
                if budget and r.num_pending > 1:
                    n = min(r.num_pending, budget)
                    work.append((r, n))
                    budget -= n
            needs = [-(-(r.computed_len + n) // ps) - len(r.pages) for r, n in work]
            total = sum(needs)
            if total == 0 or self.allocator.can_alloc(total):
                break
            if len(self.running) == 1:
                # Alone and still short: only possible if the pool cannot hold it at all.
                (r,) = self.running
                self._finish(r, "error", "request does not fit in the KV pool even after evicting everything")
                self._pending.append(self._output(r))
                return [], self.config.max_num_tokens
            victim = min(self.running, key=lambda r: (r.num_output, -r.arrival_step))
            self._retract(victim)
            retracted = True
        if not retracted:
            self.new_token_ratio = max(
                self.config.min_new_token_ratio, self.new_token_ratio - self.config.new_token_ratio_decay
            )
        if total:
            pages = self.allocator.alloc(total)
            i = 0
            for (r, _), k in zip(work, needs):
                if k:
                    self.page_table.append(r.slot, len(r.pages), pages[i : i + k])
                    r.pages += pages[i : i + k]
                    i += k
        return work, budget

    def _expected_len(self, r: Request) -> int:
        """Tokens ``r`` is expected to hold at its end: what it has, plus its remaining output
        (``max_tokens`` less what it already produced, capped) scaled by the new-token ratio,
        and never past the context it may reach (``max_total_len``)."""
        remaining_out = min(r.params.max_tokens - r.num_output, self.config.reserve_tokens_cap)
        future = int(max(0, remaining_out) * self.new_token_ratio)
        return min(len(r.token_ids) + future, max(r.max_total_len, len(r.token_ids)))

    def _reserved_pages(self, r: Request) -> int:
        """Pages ``r`` may still need beyond those it holds (see :meth:`_expected_len`)."""
        return max(0, -(-self._expected_len(r) // self.page_size) - len(r.pages))

    def _admit(self, budget: int, work: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        ps = self.page_size
        cfg = self.config
        reserved = sum(self._reserved_pages(r) for r in self.running)
        # Requests computing uncached tokens now (or in coming steps): others may wait for them.
        inflight = [r for r, n in work if n > 1 or r.num_pending > n]
        admitted: list[tuple[Request, int]] = []
        deferring = cfg.defer_shared_prefix_tokens > 0 and not self.cache.disabled
        for req in self.policy.order(self.waiting, self.counters.steps):
            if budget <= 0 or len(self.running) >= cfg.max_running_requests:
                break
            tokens = req.token_ids[: req.match_limit]
            # Deciding to defer only peeks: a request passed over must not touch the tree.
            if deferring and self._should_defer(req, self.cache.peek_prefix_len(tokens, req.namespace), inflight):
                continue
            # The cache's hit counters count admissions, not every step a request waits.
            match = self.cache.match_prefix(tokens, req.namespace, record_stats=False)
            m = match.matched_len
            n = min(len(req.token_ids) - m, budget)
            self.cache.lock(match.node)
            need_now = -(-(m + n) // ps) - len(match.pages)
            need_all = -(-self._expected_len(req) // ps) - len(match.pages)
            available = self.allocator.num_free + self.cache.num_evictable_pages
            idle = not self.running
            if need_now > available or (not idle and need_all + reserved > available):
                self.cache.unlock(match.node)
                break
            try:
                new_pages = self.allocator.alloc(need_now)
            except OutOfPagesError:
                self.cache.unlock(match.node)
                break
            reserved += max(0, need_all - need_now)
            self.cache.record_lookup(len(tokens), m)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.lock_node = match.node
            req.pages = match.pages + new_pages
            req.cached_len = req.computed_len = m
            req.slot = self.page_table.acquire()
            self.page_table.set_row(req.slot, req.pages)
            if req.cached_tokens is None:
                req.cached_tokens = min(m, req.prompt_len)
                self.counters.prompt_tokens += req.prompt_len
                self.counters.cached_prompt_tokens += req.cached_tokens
            self.running.append(req)
            admitted.append((req, n))
            inflight.append(req)
            budget -= n
        if admitted:
            self._count_bypasses([r for r, _ in admitted])
        return admitted

    def _should_defer(self, req: Request, matched: int, inflight: list[Request]) -> bool:
        """Whether another request is computing at least the next few uncached tokens of ``req``."""
        want = matched + self.config.defer_shared_prefix_tokens
        want += -want % self.page_size  # only whole pages become shareable
        if want > req.match_limit:
            return False
        key = req.token_ids[:want]
        for other in inflight:
            if other.namespace == req.namespace and len(other.token_ids) > want and other.token_ids[:want] == key:
                return True
        return False

    def _count_bypasses(self, admitted: list[Request]) -> None:
        newest_admitted = max(r.arrival_step for r in admitted)
        for r in self.waiting:
            if r.arrival_step < newest_admitted:
                r.bypassed += sum(1 for a in admitted if a.arrival_step > r.arrival_step)

    # ------------------------------------------------------------------ results

    def _process(
        self,
        work: list[tuple[Request, int]],
        plan: LogitsPlan,
        sampled: object,
        prompt_lps: list[float],
    ) -> list[RequestOutput]:
        i = 0
        for req, lo, count in plan.prompt_spans:
            assert req.prompt_logprobs is not None
            req.prompt_logprobs.extend(prompt_lps[i : i + count])
            req.prompt_lp_next = lo + count
            i += count
        for req, n in work:
            req.computed_len += n
            if n > 1 and not self.cache.disabled:
                self._cache_computed(req)
        outputs: list[RequestOutput] = []
        if sampled is None:
            return outputs
        tokens, logprobs = sampled.token_ids, sampled.logprobs  # type: ignore[attr-defined]
        self.counters.generated_tokens += len(tokens)
        for req, tok, lp in zip(plan.sample_reqs, tokens, logprobs):
            req.token_ids.append(tok)
            req.new_token_ids.append(tok)
            if lp is not None:
                if req.new_logprobs is None:
                    req.new_logprobs = []
                req.new_logprobs.append(lp)
            if req.grammar is not None and not req.grammar.accept(tok):  # the mask makes this unreachable
                self._finish(req, "error", f"sampled token {tok} is not allowed by the request's grammar")
                outputs.append(self._output(req))
                continue
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
            outputs.append(self._output(req))
        return outputs

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if req.grammar is not None and req.grammar.can_only_end:  # complete, and nothing more may follow
            return "stop"
        if req.num_output >= p.max_tokens or len(req.token_ids) >= req.max_total_len:
            return "length"
        return None

    def _output(self, req: Request) -> RequestOutput:
        prompt_lps = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and (req.new_token_ids or req.finished):
            prompt_lps, req.prompt_logprobs_sent = req.prompt_logprobs, True
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=req.new_token_ids,
            new_logprobs=req.new_logprobs,
            prompt_logprobs=prompt_lps,
            finished=req.finished,
            finish_reason=req.finish_reason,
            error=req.error,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_tokens or 0,
            completion_tokens=req.num_output,
        )
        req.new_token_ids = []
        req.new_logprobs = None
        return out

    # ------------------------------------------------------------------ KV references

    def _cache_computed(self, req: Request) -> None:
        """Insert the request's computed whole pages into the tree; re-point its lock."""
        res = self.cache.cache_prefix(req.token_ids[: req.computed_len], req.pages, req.lock_node, req.namespace)
        if res.pages != req.pages:
            self.page_table.set_row(req.slot, res.pages)
        req.pages, req.lock_node, req.cached_len = res.pages, res.node, res.cached_len

    def _release(self, req: Request) -> None:
        """Give back every reference ``req`` holds: cache its KV, unlock, free its private pages."""
        if req.status is not RequestStatus.RUNNING:
            return
        if not self.cache.disabled:
            self._cache_computed(req)
        self.cache.unlock(req.lock_node)
        self.allocator.free(req.pages[req.cached_len // self.page_size :])
        self.page_table.release(req.slot)
        self.running.remove(req)
        req.pages, req.lock_node, req.slot = [], None, -1
        req.cached_len = req.computed_len = 0

    def _retract(self, req: Request) -> None:
        """Send a running request back to the queue; it keeps its output and is recomputed later."""
        logger.debug("retracting %s", req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.counters.retractions += 1
        self.waiting.append(req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.status is RequestStatus.RUNNING:
            self._release(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        if req.params.pin_ttl_s is not None and reason in ("stop", "length"):
            self.cache.pins.pin(req.token_ids[: req.prompt_len], req.namespace, req.params.pin_ttl_s)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        self.requests.pop(req.request_id, None)
        if reason == "abort":
            self.counters.aborted += 1
        else:
            self.counters.finished += 1
