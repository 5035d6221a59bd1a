"""The scheduler's configuration, counters and per-step results (plain data, no logic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduling knobs (the engine fills them from its EngineConfig)."""

    page_size: int
    max_num_tokens: int
    max_running_requests: int
    max_total_len: int  # prompt + output of one request, bounded by the model and the pool
    schedule_policy: str = "lpm"  # "lpm" | "fcfs"
    # LPM aging bound: a waiting request overtaken this many times by later arrivals
    # jumps the LPM order (no starvation of cold requests).
    lpm_max_bypass: int = 32
    # Above this many waiting requests LPM's per-step matching costs too much: use FCFS.
    lpm_max_queue: int = 256
    # A request whose uncached prefix shares at least this many tokens with a prefill in
    # flight waits for it to land in the cache instead of computing it again.
    defer_shared_prefix_tokens: int = 32
    # Fraction of each running request's remaining max_tokens reserved at admission
    # (decays while nothing is retracted, jumps back up on retraction).
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002
    reserve_tokens_cap: int = 4096  # at most this much of a request's max_tokens is reserved
    # Speculative decoding (radixserve.speculative): the drafter ("ngram" | "radix"; None: off)
    # and the most tokens a request drafts per step; no drafting while more requests than
    # ``speculative_disable_by_batch_size`` are running or waiting (vLLM's flag of that name).
    speculative_algorithm: str | None = None
    speculative_num_tokens: int = 4
    speculative_disable_by_batch_size: int = 8
    # Predicted outputs: a request's ``params.prediction`` is drafted from (with or without an
    # algorithm; radixserve.speculative.prediction). The engine sets it where speculative
    # decoding can run.
    predicted_outputs: bool = False


# One sampled token's logprobs: its own, its top-k ``(token_id, logprob)``s, and the logprobs of
# the token ids its request asked for (``SamplingParams.logprob_token_ids``, SGLang's
# ``token_ids_logprob``, in that order; empty when it asked for none).
RowLogprobs = tuple[float, list[tuple[int, float]], list[float]]


class RequestOutput(NamedTuple):
    """What one request got out of one step (the engine wraps it in a StepOutput)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[RowLogprobs] | None
    prompt_logprobs: list[float | None] | None
    finished: bool
    finish_reason: str | None
    error: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cached_host_tokens: int = 0  # of cached_tokens, loaded back from L2 / L3
    cached_disk_tokens: int = 0
    spec_drafted_tokens: int = 0  # speculative decoding: tokens drafted, and of those accepted
    spec_accepted_tokens: int = 0
    cache_report: Any = None  # a memory.miss_report.Divergence, once, when one was asked
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None  # with prompt_logprobs
    prompt_logprob_ranks: list[int | None] | None = None  # with prompt_logprobs
    # With prompt_logprobs and params.logprob_token_ids: each position's of those tokens.
    prompt_asked_logprobs: list[list[float]] | None = None
    error_code: Literal["invalid_params"] | None = None  # the request's own fault (Request)
    embedding: list[float] | None = None  # params.return_embedding, once
    # params.return_hidden_states: the final-norm outputs of the positions read since the last.
    hidden_states: list[list[float]] | None = None


@dataclass
class SchedulerCounters:
    """Monotonic counters over the scheduler's life."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_prompt_tokens: int = 0  # of those, reused from the cache
    computed_tokens: int = 0  # rows run through the model
    generated_tokens: int = 0
    retractions: int = 0
    finished: int = 0
    aborted: int = 0
    # Speculative decoding: requests' verifications (one per request per verify step), the
    # tokens they drafted and the drafts accepted.
    spec_verifies: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
