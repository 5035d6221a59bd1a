"""Each engine's part of a prefilled request: the decode side reserves pages and admits, the
prefill side computes the prompt and writes the missing pages.

One request, between a decode engine D and a prefill engine P (the caller carries the
messages: a test, or the router between two workers)::

    D.disagg.reserve(prompt)  ──PrefillTicket(rid, D's pool, pages to fill, held_len)──>
                                             P.disagg.prefill(prompt, params, ticket)
                                             P.step() ... the prompt runs (max_tokens=1);
                                             as it finishes, before its pages are released,
                                             the KV of tokens [held_len, prompt_len) is
                                             written into D's pages (one batch per request)
    D.disagg.finish(result)   <──PrefillResult(rid, first token | error, bytes)──
    D.step() ... decodes from the first token on; no prompt token is computed on D

The prefix D already holds (``held_len``, page-aligned, matched in D's own cache under the
request's namespace) is not transferred. D frees a reservation only on P's answer (the
pages were written, or P will never write them: aborted, failed), or when P is known to be
gone, because a write may still be landing until then.

Where radixserve differs from SGLang's Mooncake disaggregation: the transfer is synchronous
on P's step thread (SGLang queues it to a transfer thread pool and polls), and the first
token travels in the answer rather than in an auxiliary-data buffer written by the transfer
engine. As in SGLang, each tensor-parallel rank writes its own pool's slice, whole pages rank
to rank for equal TP sizes and heads sliced per token for differing ones
(:mod:`.rank_transfer`); the ticket carries one pool descriptor per decode rank.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import msgspec

from radixserve.distributed.disagg.kv_transfer import (
    PoolDescriptor,
    TransferError,
    TransferStats,
)
from radixserve.distributed.disagg.rank_transfer import RankedTransfer, RankLink, open_transfer
from radixserve.engine.config import EngineConfig
from radixserve.engine.intake import RequestIntake
from radixserve.memory.pool import KVPool
from radixserve.sampling_params import SamplingParams
from radixserve.scheduling.request import Request, RequestStatus
from radixserve.scheduling.scheduler import Scheduler
from radixserve.scheduling.types import RowLogprobs

__all__ = [
    "DecodeRole",
    "DisaggStats",
    "PrefillResult",
    "PrefillRole",
    "PrefillTicket",
    "make_role",
]


class PrefillTicket(msgspec.Struct, frozen=True):
    """What the decode engine tells the prefill engine: where the prompt's KV goes."""

    request_id: str
    pools: list[PoolDescriptor]  # the decode engine's, one per tensor-parallel rank
    fill_pages: list[int]  # decode pages for tokens [held_len, prompt_len), in order
    held_len: int  # leading tokens the decode engine already holds: not transferred
    # The reservation's lease (unix time; 0: none): the prefill engine starts no write after
    # it, and the decode engine gives the pages back RELEASE_GRACE_S later (see expire).
    write_by: float = 0.0


class PrefillResult(msgspec.Struct, frozen=True):
    """What the prefill engine answers: the first token, or why there is none."""

    request_id: str
    first_token: int | None
    bytes: int = 0
    error: str | None = None  # "abort", or what failed (nothing usable was written)
    # The first token's logprob and top alternatives, when the request asked for logprobs
    # (SGLang's PD likewise returns the first token's logprobs from the prefill side).
    first_logprob: RowLogprobs | None = None


class DisaggStats(NamedTuple):
    """A role's counters: its transfer engine's, and the prompt tokens it moved or received."""

    transfer: TransferStats
    requests: int  # prefilled (prefill side) / admitted (decode side)
    cancelled: int  # reservations given back unused (decode side) / results with an error
    held_tokens: int  # decode side: prompt tokens its own cache already held
    moved_tokens: int  # prompt tokens whose KV was written (prefill) or received (decode)


class _Role:
    def __init__(
        self, scheduler: Scheduler, intake: RequestIntake, transfer: RankedTransfer
    ) -> None:
        self.scheduler = scheduler
        self.intake = intake
        self.transfer = transfer
        self._requests = self._cancelled = self._held = self._moved = 0

    def stats(self) -> DisaggStats:
        return DisaggStats(
            self.transfer.stats(), self._requests, self._cancelled, self._held, self._moved
        )

    def close(self) -> None:
        self.transfer.close()

    def _make(
        self, prompt: list[int], params: SamplingParams, rid: str | None, namespace: str | None
    ) -> Request:
        req = self.intake.make_request(prompt, params, rid, namespace, self.scheduler.requests)
        if req.prompt_logprobs is not None:
            raise ValueError("disaggregated requests take no prompt logprobs (yet)")
        return req


# A write the prefill engine started before the lease's end must land before the decode
# engine reuses the pages: this long after ``write_by`` (a lease of T seconds gets max(this,
# T / 2)); clocks of the two hosts are assumed to agree within it.
RELEASE_GRACE_S = 2.0


class DecodeRole(_Role):
    """The decode engine's side: reserve pages, admit the prefilled request, or cancel."""

    def __init__(
        self, scheduler: Scheduler, intake: RequestIntake, transfer: RankedTransfer
    ) -> None:
        super().__init__(scheduler, intake, transfer)
        self._release_at: dict[str, float] = {}  # leased reservations: when they lapse

    def reserve(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        namespace: str | None = None,
        timeout_s: float | None = None,
    ) -> PrefillTicket | None:
        """Hold this cache's prefix of ``prompt`` and pages for the rest; None when no row or
        pages are free now. ``ValueError`` for what ``Engine.add_request`` refuses.
        ``timeout_s``: the lease; past it :meth:`expire` gives the pages back."""
        req = self._make(prompt, params or SamplingParams(), request_id, namespace)
        res = self.scheduler.prefilled.reserve(req)
        if res is None:
            return None
        write_by = 0.0
        if timeout_s is not None:
            write_by = time.time() + timeout_s
            self._release_at[req.request_id] = write_by + max(RELEASE_GRACE_S, timeout_s / 2)
        return PrefillTicket(
            req.request_id, self.transfer.pools, res.fill_pages, res.held_len, write_by
        )

    def expire(self, now: float | None = None) -> list[str]:
        """Give back the reservations whose lease ran out (the prefill side will not write
        after ``write_by``); their request ids."""
        now = time.time() if now is None else now
        gone = [rid for rid, t in self._release_at.items() if t <= now]
        for rid in gone:
            self.cancel(rid)
        return gone

    def finish(self, result: PrefillResult) -> bool:
        """Apply the prefill engine's answer: admit (its first token comes with the next step)
        or give the reservation back. Returns whether the request now runs here."""
        if result.request_id not in self.scheduler.prefilled:
            return False  # cancelled meanwhile
        if result.first_token is None:
            self.cancel(result.request_id)
            return False
        self._release_at.pop(result.request_id, None)
        res = self.scheduler.prefilled.get(result.request_id)
        self._held += res.held_len
        self._moved += res.request.prompt_len - res.held_len
        self._requests += 1
        self.scheduler.admit_prefilled(result.request_id, result.first_token, result.first_logprob)
        return True

    def cancel(self, request_id: str) -> bool:
        """Give back a reservation (only once the prefill engine will not write into it)."""
        self._release_at.pop(request_id, None)
        done = self.scheduler.prefilled.cancel(request_id)
        self._cancelled += done
        return done


class PrefillRole(_Role):
    """The prefill engine's side: run prompts for tickets, write their pages, answer."""

    def __init__(
        self, scheduler: Scheduler, intake: RequestIntake, transfer: RankedTransfer
    ) -> None:
        super().__init__(scheduler, intake, transfer)
        self._tickets: dict[str, PrefillTicket] = {}
        self._results: list[PrefillResult] = []
        scheduler.on_finish = self._on_finish

    def prefill(
        self,
        prompt: list[int],
        params: SamplingParams | None,
        ticket: PrefillTicket,
        namespace: str | None = None,
    ) -> str:
        """Queue ``prompt`` to be computed for ``ticket``; its answer comes from
        :meth:`take_results` after the step that finishes it."""
        p = params or SamplingParams()
        one = msgspec.structs.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1))
        req = self._make(prompt, one, ticket.request_id, namespace)
        if len(ticket.fill_pages) != -(-len(prompt) // self.transfer.pool.page_size) - (
            ticket.held_len // self.transfer.pool.page_size
        ):
            raise ValueError("the ticket's pages do not cover the prompt past its held prefix")
        self._tickets[req.request_id] = ticket
        self.scheduler.add(req)
        return req.request_id

    def take_results(self) -> list[PrefillResult]:
        """Answers of the prompts finished since the last call."""
        out, self._results = self._results, []
        return out

    def _on_finish(self, req: Request, reason: str) -> None:
        """A request finishes (before its pages are released): write its prompt's missing
        pages into the decode pool and answer with its first token, or answer why not."""
        ticket = self._tickets.pop(req.request_id, None)
        if ticket is None:
            return
        rid = req.request_id
        if req.status is not RequestStatus.RUNNING or reason not in ("stop", "length"):
            self._answer(PrefillResult(rid, None, 0, reason))
            return
        if ticket.write_by and time.time() > ticket.write_by:
            self._answer(PrefillResult(rid, None, 0, "the decode side's reservation expired"))
            return
        ps = self.transfer.pool.page_size
        src = req.pages[ticket.held_len // ps : -(-req.prompt_len // ps)]
        try:
            # A rank lost meanwhile raises RankFailure (a StepFailure) through this: the step
            # loop fails the request, pages back, and the engine stops; no answer is sent, as
            # the decode side must keep its pages until this engine's processes are gone.
            written = self.transfer.write(ticket.pools, src, ticket.fill_pages)
        except (TransferError, ValueError) as e:
            self._answer(PrefillResult(rid, None, 0, f"{type(e).__name__}: {e}"))
            return
        self._moved += req.prompt_len - ticket.held_len
        self._requests += 1
        lp = req.new_logprobs[-1] if req.new_logprobs else None  # its one sampled token's
        self._answer(PrefillResult(rid, req.token_ids[req.prompt_len], written, None, lp))

    def _answer(self, result: PrefillResult) -> None:
        self._cancelled += result.error is not None
        self._results.append(result)


def make_role(
    cfg: EngineConfig,
    scheduler: Scheduler,
    intake: RequestIntake,
    pool: KVPool,
    model: Any,
    link: RankLink | None = None,
) -> PrefillRole | DecodeRole | None:
    """The engine's disaggregation role (None without ``disaggregation_mode``): its pool (the
    heads of ``model``'s shard) registered with a transfer engine listening on
    ``disaggregation_hostname``; ``link``: the other tensor-parallel ranks' (:mod:`.rank_transfer`)."""
    if cfg.disaggregation_mode is None:
        return None
    transfer = RankedTransfer(open_transfer(cfg, pool, model), link)
    role = PrefillRole if cfg.disaggregation_mode == "prefill" else DecodeRole
    return role(scheduler, intake, transfer)
