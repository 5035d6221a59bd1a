"""One request's state inside the scheduler: its tokens, its KV pages, its progress.

A request's tokens and the KV that backs them, at any moment::

    token_ids:   | prompt ........................ | output ............ |
                 0                      prompt_len                 len(token_ids)
    KV in pages: | tree pages (locked) | private pages |
                 0            cached_len       computed_len   (<= len(token_ids) - 1 while decoding)

- ``pages[i]`` backs positions ``i*page_size .. (i+1)*page_size - 1``; the first
  ``cached_len // page_size`` pages belong to the radix tree and are protected by one lock
  on ``lock_node``; the rest are the request's own (private) pages, the last maybe partial.
- Each step computes ``token_ids[computed_len : computed_len + n]``. When that reaches the
  end of ``token_ids`` the last row's logits give the next token; otherwise it was one
  chunk of a chunked prefill (or of a recompute after retraction).
- Retraction keeps ``token_ids`` (prompt and output so far) and drops all KV: the request
  is recomputed later over prompt + output, reusing whatever the cache still holds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from radixserve.constrained.interface import TokenGrammar
from radixserve.sampling_params import SamplingParams
from radixserve.scheduling.types import RequestOutput, RowLogprobs

if TYPE_CHECKING:
    from radixserve.memory.tree_node import TreeNode
    from radixserve.speculative.adaptive import AdaptiveK


# The placeholder for a token a launched step samples, until its results are read
# (overlap scheduling); never a real token id.
FUTURE_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A request in the scheduler (identity-compared; one object per request id)."""

    request_id: str
    token_ids: list[int]  # prompt + output so far
    prompt_len: int
    params: SamplingParams
    max_total_len: int  # stop with "length" when len(token_ids) reaches this
    namespace: str | None = None
    # The session this request is a turn of (router session id, DSL program id, or adopted
    # from the tree: memory.leases); its priority (higher leaves the cache last).
    session_id: str | None = None
    priority: int = 0
    arrival_step: int = 0
    generator: torch.Generator | None = None
    # Constrained decoding: the request's GrammarMatcher (radixserve.constrained), advanced
    # with every sampled token; kept across retraction because the tokens are kept.
    grammar: TokenGrammar | None = None
    # The LoRA adapter it runs with (model.lora's slot; 0: the base model).
    lora_slot: int = 0

    status: RequestStatus = RequestStatus.WAITING
    # KV state (see the module docstring).
    pages: list[int] = field(default_factory=list)
    lock_node: TreeNode | None = None  # the locked end of its cached prefix
    cached_len: int = 0
    computed_len: int = 0
    slot: int = -1  # row of the scheduler's page table while running
    # A window pool (memory.window_pool): its private pages before this one have given
    # their window pages back (its window has passed them).
    window_lo: int = 0
    page_size_hint: int = 1  # the pool's page size (set at admission; usage arithmetic)
    # Accounting.
    cached_tokens: int | None = None  # prompt tokens reused at first admission (usage)
    loaded_pages: tuple[int, int] = (0, 0)  # of those, pages loaded from L2, L3 (last admission)
    # Where its prompt left the cached path and why (memory.miss_report.Divergence, or
    # "no_cache"), made at first admission when asked; sent with the next output, once.
    cache_report: Any = None
    num_retractions: int = 0
    bypassed: int = 0  # times a later arrival was admitted first (LPM aging)
    # Prompt logprobs: positions whose logits are still needed, and the values so far.
    prompt_lp_next: int = 0  # next row position whose logits give a prompt logprob
    prompt_logprobs: list[float | None] | None = None
    # With ``params.prompt_top_k`` k > 0, each position's k likeliest (token, logprob) too.
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Each scored token's rank in its position's distribution (None for position 0).
    prompt_logprob_ranks: list[int | None] | None = None
    # With ``params.logprob_token_ids``, each position's logprobs of those tokens (none at 0).
    prompt_asked_logprobs: list[list[float]] | None = None
    prompt_logprobs_sent: bool = False
    # params.return_embedding: the prompt's last row's final-norm output, once computed;
    # sent with the output that follows.
    embedding: list[float] | None = None
    embedding_sent: bool = False
    # params.return_hidden_states: the final norm's output at positions 0, 1, ... (None: not
    # asked), the next position a launched step has not computed it for yet, and how many
    # have gone out.
    hidden_states: list[list[float]] | None = None
    hidden_next: int = 0
    hidden_sent: int = 0
    # Tokens produced since the last StepOutput, with their logprobs.
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[RowLogprobs] | None = None
    finish_reason: str | None = None
    error: str | None = None
    # Whose fault an error was, as the wire names it: "invalid_params" when the request's own
    # parameters made it fail (a grammar too costly to follow); None: the engine's.
    error_code: Literal["invalid_params"] | None = None
    # Overlap scheduling: the row of this request's sampled token in the last launched step,
    # and whether that step's token is certain to be its last (a length stop).
    future_index: int = -1
    finishing: bool = False
    # Speculative decoding (scheduling.speculation): the tokens drafted for the step being
    # planned or run (they follow ``token_ids``, and are not part of it), this request's
    # adaptive draft length, and its drafted / accepted counts (usage). ``speculates``: set at
    # its first decode step, whether the scheduler's load then let it speculate (if not, it
    # never does).
    drafts: list[int] = field(default_factory=list)
    speculates: bool | None = None
    spec: AdaptiveK | None = None
    spec_drafted: int = 0
    spec_accepted: int = 0

    def __post_init__(self) -> None:
        start = self.params.prompt_logprobs_from
        if start is not None:
            start = min(start, self.prompt_len)
            first = start == 0 and self.prompt_len > 0  # position 0: nothing predicts it
            self.prompt_logprobs = [None] if first else []
            self.prompt_logprob_ranks = [None] if first else []
            if self.params.prompt_top_k:
                self.prompt_top_logprobs = [[] for _ in self.prompt_logprobs]
            if self.params.logprob_token_ids:
                self.prompt_asked_logprobs = [[] for _ in self.prompt_logprobs]
            self.prompt_lp_next = max(start, 1) - 1
        else:
            self.prompt_lp_next = self.prompt_len  # nothing to collect
        if self.params.return_hidden_states:
            self.hidden_states = []

    @property
    def prediction(self) -> list[int] | None:
        """The output the client expects, as token ids (a drafter's source: speculative)."""
        return self.params.prediction

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_output_known(self) -> int:
        """Output tokens read back so far (without the placeholder of a step in flight)."""
        return self.num_output - (self.token_ids[-1] == FUTURE_TOKEN)

    def take_output(self) -> RequestOutput:
        """What this request produced since the last call (tokens, logprobs, finish)."""
        prompt_lps = prompt_top = prompt_ranks = prompt_asked = None
        if (
            self.prompt_logprobs is not None
            and not self.prompt_logprobs_sent
            and (self.new_token_ids or self.finished)
        ):
            prompt_lps, self.prompt_logprobs_sent = self.prompt_logprobs, True
            prompt_top, prompt_ranks = self.prompt_top_logprobs, self.prompt_logprob_ranks
            prompt_asked = self.prompt_asked_logprobs
        embedding = None
        if self.embedding is not None and not self.embedding_sent:
            embedding, self.embedding_sent = self.embedding, True
        out = RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.new_token_ids,
            new_logprobs=self.new_logprobs,
            prompt_logprobs=prompt_lps,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=self.error,
            error_code=self.error_code,
            prompt_tokens=self.prompt_len,
            cached_tokens=self.cached_tokens or 0,
            completion_tokens=self.num_output_known,
            cached_host_tokens=self.cached_host_tokens,
            cached_disk_tokens=self.cached_disk_tokens,
            spec_drafted_tokens=self.spec_drafted,
            spec_accepted_tokens=self.spec_accepted,
            cache_report=self.cache_report,
            prompt_top_logprobs=prompt_top,
            prompt_logprob_ranks=prompt_ranks,
            prompt_asked_logprobs=prompt_asked,
            embedding=embedding,
            hidden_states=self._take_hidden(),
        )
        self.cache_report = None
        self.new_token_ids = []
        self.new_logprobs = None
        return out

    def _take_hidden(self) -> list[list[float]] | None:
        """The hidden states not sent yet, of the positions before the newest token (the
        model never reads the last one; a rejected draft's row is beyond it), so that the
        receiver, which may end the output at a stop string, holds them all when it does."""
        if self.hidden_states is None:
            return None
        hi = min(len(self.hidden_states), len(self.token_ids) - 1)
        if hi <= self.hidden_sent:
            return None
        new, self.hidden_sent = self.hidden_states[self.hidden_sent : hi], hi
        return new

    @property
    def cached_host_tokens(self) -> int:
        """Usage: cached prompt tokens that came from host memory (L2) at first admission."""
        return min(self.loaded_pages[0] * self.page_size_hint, self.cached_tokens or 0)

    @property
    def cached_disk_tokens(self) -> int:
        host = self.cached_host_tokens
        return min(self.loaded_pages[1] * self.page_size_hint, (self.cached_tokens or 0) - host)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.token_ids) - self.computed_len

    @property
    def is_decoding(self) -> bool:
        return self.num_pending == 1

    @property
    def wants_embedding(self) -> bool:
        """It asked for the prompt's embedding and has not got it yet (the prompt's last row
        is computed once: a request retracted after it keeps what it got)."""
        return self.params.return_embedding and self.embedding is None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Some prompt position still needs its logits computed."""
        return self.prompt_lp_next < self.prompt_len - 1

    @property
    def match_limit(self) -> int:
        """How many leading tokens may come from the cache.

        At least the last token is always computed (its logits give the next token), and
        prompt positions whose logprobs or hidden states are still wanted must be computed too.
        """
        limit = len(self.token_ids) - 1
        if self.wants_prompt_logprobs:
            limit = min(limit, self.prompt_lp_next)
        if self.hidden_states is not None:  # positions whose hidden state is still wanted
            limit = min(limit, self.hidden_next)
        return limit

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def fill_placeholder(self, tok: int, lp: RowLogprobs | None) -> int:
        """The token a resolved step sampled for this request replaces its placeholder; returns
        its position. (With overlap, a later step in flight may have appended its own
        placeholder after this one.)"""
        pos = len(self.token_ids) - 1
        if self.token_ids[pos] != FUTURE_TOKEN or self.token_ids[pos - 1] == FUTURE_TOKEN:
            pos -= 1  # a later step in flight appended its own placeholder after this one
        assert self.token_ids[pos] == FUTURE_TOKEN, self
        self.token_ids[pos] = tok
        self.new_token_ids.append(tok)
        if lp is not None:
            if self.new_logprobs is None:
                self.new_logprobs = []
            self.new_logprobs.append(lp)
        return pos

    def end_at(self, pos: int) -> None:
        """This request ends with the token at ``pos``: drop what a later step in flight added
        (its placeholder; the KV it computes stays private and is freed after it)."""
        del self.token_ids[pos + 1 :]
        self.computed_len = min(self.computed_len, pos)

    def stop_reason(self, tok: int, length: int, eos_token_ids: frozenset[int]) -> str | None:
        """Why this request stops after ``tok``, its tokens then being ``length`` long (None:
        it goes on)."""
        p = self.params
        if (tok in eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if (
            self.grammar is not None and self.grammar.can_only_end
        ):  # complete, and nothing more may follow
            return "stop"
        if length - self.prompt_len >= p.max_tokens or length >= self.max_total_len:
            return "length"
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.prompt_len}, out={self.num_output}, "
            f"computed={self.computed_len}, cached={self.cached_len}, pages={len(self.pages)})"
        )
