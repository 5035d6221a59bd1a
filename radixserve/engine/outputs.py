"""What the engine hands back: torch-free msgspec Structs.

The worker sends :class:`StepOutput` over the wire as it is, so nothing here may import
torch; the router, the gateways and the DSL decode these without the model stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from radixserve.sampling_params import read_positions

if TYPE_CHECKING:
    from radixserve.scheduling.types import RequestOutput

FinishReason = Literal["stop", "length", "abort", "error"]


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """The logprob of one chosen token, the top alternatives when asked for, and the logprobs
    of the token ids the request named (``SamplingParams.logprob_token_ids``, in its order).

    Logprobs are taken from the model's distribution (raw logits, before temperature,
    penalties and filters), as OpenAI and vLLM report them.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []
    asked: list[float] = []


class CacheReport(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where a prompt left the longest cached path and why the rest was not there
    (:mod:`radixserve.memory.miss_report`; asked with ``return_cache_report``).

    ``reason``: fully_cached | never_cached | evicted | lease_expired | lease_yielded |
    other_namespace | no_cache. ``diverged_at``: the first prompt token on no cached path
    (absent when every whole page is cached); ``before`` / ``after``: prompt token ids
    around it; ``cached_after``: what the cached path holds there instead, when one goes
    on; ``evicted_by`` / ``evicted_s_ago``: the policy that evicted it, and when.
    """

    reason: str
    cached_tokens: int
    diverged_at: int | None = None
    before: list[int] = []
    after: list[int] = []
    cached_after: list[int] = []
    evicted_by: str | None = None
    evicted_s_ago: float | None = None


class Usage(msgspec.Struct, frozen=True):
    """Per-request token counts.

    ``cached_tokens`` is how many prompt tokens were reused from the radix cache instead
    of computed (counted at the request's first admission). ``cache_report`` is absent
    (unset, not even encoded) unless the request asked for one.
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # Of ``cached_tokens``, those loaded back from the hierarchical cache's host memory (L2)
    # and disk (L3); the rest were in device memory (L1).
    cached_host_tokens: int = 0
    cached_disk_tokens: int = 0
    # Speculative decoding: tokens drafted for this request, and of those accepted (each
    # accepted draft is an output token that cost no forward of its own).
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    cache_report: CacheReport | msgspec.UnsetType = msgspec.UNSET


class StepOutput(msgspec.Struct, frozen=True):
    """New tokens of one request after one engine step (or its final notice).

    ``prompt_logprobs`` (positions from ``prompt_logprobs_start`` on; ``None`` for position
    0, which has no context) is sent once, with the request's first output; with
    ``logprobs`` k > 0, ``prompt_top_logprobs`` beside it holds each position's k likeliest
    ``(token_id, logprob)`` (none for position 0); ``prompt_logprob_ranks`` each scored
    token's rank in its position's distribution (1: the likeliest; ``None`` for position 0).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None
    # "invalid_params" when the request's own parameters made it fail (a grammar too costly
    # to follow): the router answers the client as for a request refused at the start.
    error_code: Literal["invalid_params"] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    # params.return_embedding: the final norm's output at the prompt's last token, once.
    embedding: list[float] | None = None
    # With params.logprob_token_ids: each prompt position's logprobs of those tokens (empty
    # for position 0), beside prompt_logprobs.
    prompt_asked_logprobs: list[list[float]] | None = None
    # params.return_hidden_states: the final norm's output at the positions the model read
    # since the last output (the prompt's, then each output token's but the last); the
    # receiver appends them (Engine.generate and the router return them whole, at the end).
    hidden_states: list[list[float]] | None = None


@dataclass
class OutputExtras:
    """What a request's outputs carry besides its tokens, folded in as they come: the prompt
    logprobs (sent once), the embedding (once) and the hidden states (appended per output).

    Both receivers of :class:`StepOutput` keep one (``Engine.generate``'s collector and the
    router's request state) and hand :meth:`fields` to the result they build, whose fields
    have these names (:class:`GenerateOutput`, the wire's ``GenerateFinal``)."""

    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    prompt_asked_logprobs: list[list[float]] | None = None
    embedding: list[float] | None = None
    hidden_states: list[list[float]] | None = None

    def take(self, out: StepOutput) -> None:
        """Fold in one output's extras."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
            self.prompt_top_logprobs = out.prompt_top_logprobs
            self.prompt_logprob_ranks = out.prompt_logprob_ranks
            self.prompt_asked_logprobs = out.prompt_asked_logprobs
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.hidden_states is not None:  # the positions read since the last output
            self.hidden_states = (self.hidden_states or []) + out.hidden_states

    def fields(self, prompt_len: int, output_len: int) -> dict[str, Any]:
        """The result's fields: every extra, the hidden states of the positions read of a
        prompt and an output of these lengths (``read_positions``)."""
        return {
            "prompt_logprobs": self.prompt_logprobs,
            "prompt_top_logprobs": self.prompt_top_logprobs,
            "prompt_logprob_ranks": self.prompt_logprob_ranks,
            "prompt_asked_logprobs": self.prompt_asked_logprobs,
            "embedding": self.embedding,
            "hidden_states": read_positions(self.hidden_states, prompt_len, output_len),
        }


class GenerateOutput(msgspec.Struct, frozen=True):
    """The finished result of one request of :meth:`Engine.generate`."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    usage: Usage
    prompt_token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[float | None] | None = None
    error: str | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None  # with logprobs k > 0
    # The stop string that ended the text (None: none did; a stop token shows in token_ids).
    matched_stop: str | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # with prompt_logprobs
    embedding: list[float] | None = None  # with return_embedding
    prompt_asked_logprobs: list[list[float]] | None = None  # with logprob_token_ids
    hidden_states: list[list[float]] | None = None  # with return_hidden_states: one per position


class EngineStats(msgspec.Struct, frozen=True):
    """A snapshot of the engine's scheduler and KV memory.

    Counters (``*_total``) are monotonic over the engine's life; the rest are gauges.
    ``hit_rate`` = ``cached_prompt_tokens_total / prompt_tokens_total`` over admitted requests.
    """

    running: int
    waiting: int
    num_pages: int
    page_size: int
    pages_free: int
    pages_evictable: int
    pages_in_use: int
    cached_tokens: int  # tokens held by the radix tree now
    steps_total: int
    prompt_tokens_total: int
    cached_prompt_tokens_total: int
    computed_tokens_total: int  # rows run through the model (extend + decode)
    generated_tokens_total: int
    retractions_total: int
    evicted_pages_total: int
    finished_total: int
    aborted_total: int
    hit_rate: float
    # Hierarchical cache (zero when it is off): L2 pages held now; pages demoted L1 -> L2,
    # loaded back from L2 and from L3, written to L3, and L3 files rejected as corrupt.
    host_cached_pages: int = 0
    demoted_pages_total: int = 0
    loaded_host_pages_total: int = 0
    loaded_storage_pages_total: int = 0
    storage_written_pages_total: int = 0
    storage_corrupt_pages_total: int = 0
    # L3 page reads that found a verified page / did not (absent, corrupt, too slow, store
    # gone); reads that ran out of time; bytes read and written; seconds spent reading.
    storage_hits_total: int = 0
    storage_misses_total: int = 0
    storage_timeouts_total: int = 0
    storage_read_bytes_total: int = 0
    storage_written_bytes_total: int = 0
    storage_read_seconds_total: float = 0.0
    # Session leases (memory.leases): pages on leased paths and leases held now; leases
    # granted, turns that found their lease, leases run out, yielded to memory pressure;
    # unkeyed chats adopted as sessions; prompt tokens a returning turn recomputed that its
    # lost lease had held (what a longer lease would have saved).
    leased_pages: int = 0
    leases_active: int = 0
    leases_granted_total: int = 0
    lease_hits_total: int = 0
    lease_expired_total: int = 0
    lease_yielded_total: int = 0
    lease_trimmed_pages_total: int = 0
    sessions_adopted_total: int = 0
    lease_lost_tokens_total: int = 0
    # Eviction policy (memory.eviction): the configured one, the one followed now (adaptive's
    # choice), adaptive's switches, and each candidate's regret on its shadow cache (tokens
    # recomputed within the horizon of their eviction; adaptive only).
    eviction_policy: str = "lru"
    eviction_policy_active: str = "lru"
    eviction_switches_total: int = 0
    eviction_regret_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # Speculative decoding (zero when off): requests' verifications, tokens drafted, drafts
    # accepted (acceptance rate = accepted / drafted; mean accepted length = 1 + accepted /
    # verifies tokens per verify row group).
    spec_verifies_total: int = 0
    spec_drafted_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    # The draft model's own KV pool (``--speculative-algorithm draft``; zero otherwise): its
    # pages (total, free, cached and evictable) and bytes. It is allocated beside the model's
    # pool, outside the memory planner's budget (docs/speculative.md).
    spec_draft_pages: int = 0
    spec_draft_pages_free: int = 0
    spec_draft_pages_evictable: int = 0
    spec_draft_pool_bytes: int = 0
    # Miss reports (memory.miss_report). Reasons: requests that asked, or all with
    # --cache-report. Divergence positions: every admitted prompt (a cumulative histogram,
    # bucket upper bound in tokens -> prompts, and the most frequent positions with their
    # context). Flushes and the pages they dropped (their own reason, no policy's regret).
    cache_reports_total: int = 0
    cache_divergence_prompts_total: int = 0
    cache_flushes_total: int = 0
    cache_flushed_pages_total: int = 0
    cache_miss_reasons: dict[str, int] = msgspec.field(default_factory=dict)
    # Tokens recomputed within the horizon of their eviction, by the policy that evicted them
    # (the live cache, whatever its policy; eviction_regret_tokens: adaptive's shadows).
    cache_regret_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    cache_divergence_buckets: dict[str, int] = msgspec.field(default_factory=dict)
    cache_divergence_position_sum: int = 0
    cache_divergence_top: list[dict[str, Any]] = msgspec.field(default_factory=list)


def to_step_output(o: RequestOutput) -> StepOutput:
    """The scheduler's output of one request in one step, as the engine hands it out."""
    lps = None
    if o.new_logprobs is not None:
        lps = [
            TokenLogprob(t, lp, top, asked)
            for t, (lp, top, asked) in zip(o.new_token_ids, o.new_logprobs)
        ]
    return StepOutput(
        request_id=o.request_id,
        new_token_ids=o.new_token_ids,
        new_logprobs=lps,
        prompt_logprobs=o.prompt_logprobs,
        prompt_top_logprobs=o.prompt_top_logprobs,
        prompt_logprob_ranks=o.prompt_logprob_ranks,
        prompt_asked_logprobs=o.prompt_asked_logprobs,
        embedding=o.embedding,
        hidden_states=o.hidden_states,
        finished=o.finished,
        finish_reason=o.finish_reason,  # type: ignore[arg-type]
        error=o.error,
        error_code=o.error_code,
        usage=Usage(
            o.prompt_tokens,
            o.cached_tokens,
            o.completion_tokens,
            o.cached_host_tokens,
            o.cached_disk_tokens,
            o.spec_drafted_tokens,
            o.spec_accepted_tokens,
            msgspec.UNSET if o.cache_report is None else cache_report(o.cache_report),
        ),
    )


def cache_report(d: Any) -> CacheReport:
    """A :class:`~radixserve.memory.miss_report.Divergence` (or ``"no_cache"``) on the wire."""
    if isinstance(d, str):
        return CacheReport(reason=d, cached_tokens=0)
    return CacheReport(
        reason=d.reason,
        cached_tokens=d.cached_tokens,
        diverged_at=d.at,
        before=d.before,
        after=d.after,
        cached_after=d.cached_after,
        evicted_by=d.policy,
        evicted_s_ago=None if d.evicted_s_ago is None else round(d.evicted_s_ago, 3),
    )
