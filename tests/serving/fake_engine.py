"""A model-free stand-in for the Engine, for router/worker tests that need no weights.

It speaks the Engine interface the worker uses (add_request, abort, step, has_unfinished,
stats, flush_cache, check_invariants, model_config, config) and emits one deterministic
token per running request per step: token k of a prompt is ``alphabet[(sum(prompt) + k) %
len(alphabet)]``, or token k of its prediction while it has one (a model that answers as
the client expected: tests of how a prediction reaches the worker). A request with an
``ebnf`` grammar fails after its second token as one too costly to follow does in the real
engine (an ``invalid_params`` error: tests of how the router answers it). KV pages are accounted
like a prefix cache would (page-aligned prompt prefixes are cached at finish and count as
hits for later prompts), so tests can check that in-use pages return to zero and that
shared prefixes hit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec

from radixserve.engine.outputs import StepOutput, Usage
from radixserve.sampling_params import SamplingParams


class FakeStats(msgspec.Struct, frozen=True):
    running: int
    waiting: int
    num_pages: int
    page_size: int
    pages_free: int
    pages_evictable: int
    pages_in_use: int
    prompt_tokens_total: int
    cached_prompt_tokens_total: int
    aborted_total: int
    hit_rate: float


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    cached: int
    out: list[int] = field(default_factory=list)
    aborted: bool = False
    namespace: str | None = None


def fake_token(prompt: list[int], k: int, alphabet: list[int]) -> int:
    """The fake model's k-th output token for ``prompt``."""
    return alphabet[(sum(prompt) + k) % len(alphabet)]


class FakeEngine:
    def __init__(
        self,
        model: str | None = None,
        *,
        alphabet: list[int] | None = None,
        vocab_size: int = 512,
        eos_token_id: int = 2,
        context_length: int = 256,
        page_size: int = 4,
        num_pages: int = 4096,
        step_delay: float = 0.0,
        stall_after_steps: int = 0,
        stall_s: float = 0.0,
        **_: Any,
    ) -> None:
        self.alphabet = alphabet or list(range(60, 90))
        self.model_config = SimpleNamespace(
            vocab_size=vocab_size,
            eos_token_ids=(eos_token_id,),
            max_position_embeddings=context_length,
            hidden_size=64,
        )
        self.config = SimpleNamespace(page_size=page_size, max_model_len=context_length)
        self.tokenizer = SimpleNamespace(bos_token_id=1)
        self.page_size, self.num_pages, self.step_delay = page_size, num_pages, step_delay
        # After ``stall_after_steps`` steps (when > 0), every step takes ``stall_s``: a long prefill.
        self.stall_after_steps, self.stall_s, self._steps = stall_after_steps, stall_s, 0
        self._reqs: dict[str, _Req] = {}
        self._cached: set[tuple[str | None, tuple[int, ...]]] = (
            set()
        )  # (namespace, prefix), as the radix cache
        self._prompt_total = self._hit_total = self._aborted = 0
        self.sessions_seen: list[str | None] = []  # each request's session id, in order

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: str | None = None,
        session_id: str | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> str:
        params.validate()
        if lora is not None:  # as an Engine without lora_paths
            raise ValueError(f"unknown LoRA adapter {lora!r}: this engine serves none")
        self.sessions_seen.append(session_id)
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens exceeds the context")
        assert request_id is not None and request_id not in self._reqs
        ps, cached = self.page_size, 0
        for end in range(ps, len(prompt_token_ids) + 1, ps):
            if (namespace, tuple(prompt_token_ids[:end])) not in self._cached:
                break
            cached = end
        self._prompt_total += len(prompt_token_ids)
        self._hit_total += cached
        self._reqs[request_id] = _Req(
            request_id, list(prompt_token_ids), params, cached, namespace=namespace
        )
        return request_id

    def abort(self, request_id: str) -> None:
        if request_id in self._reqs:
            self._reqs[request_id].aborted = True

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def step(self) -> list[StepOutput]:
        self._steps += 1
        if self.stall_after_steps and self._steps > self.stall_after_steps:
            time.sleep(self.stall_s)  # stands for a long engine step, e.g. a big prefill chunk
        elif self.step_delay:
            time.sleep(self.step_delay)  # stands for the model's compute time
        outs = []
        for r in list(self._reqs.values()):
            usage = lambda: Usage(len(r.prompt), r.cached, len(r.out))  # noqa: E731, B023 (called in this iteration)
            if r.aborted:
                outs.append(
                    StepOutput(r.rid, [], finished=True, finish_reason="abort", usage=usage())
                )
                self._aborted += 1
                self._finish(r)
                continue
            if r.params.ebnf is not None and len(r.out) == 2:
                outs.append(
                    StepOutput(
                        r.rid,
                        [],
                        finished=True,
                        finish_reason="error",
                        error="the ebnf is too costly to follow",
                        error_code="invalid_params",
                        usage=usage(),
                    )
                )
                self._finish(r)
                continue
            k, predicted = len(r.out), r.params.prediction or []
            tok = predicted[k] if k < len(predicted) else fake_token(r.prompt, k, self.alphabet)
            r.out.append(tok)
            reason = None
            if tok in r.params.stop_token_ids:
                reason = "stop"
            elif (
                len(r.out) >= r.params.max_tokens
                or len(r.prompt) + len(r.out) >= self.config.max_model_len
            ):
                reason = "length"
            outs.append(
                StepOutput(
                    r.rid,
                    [tok],
                    finished=reason is not None,
                    finish_reason=reason,
                    usage=usage() if reason else None,
                )
            )
            if reason:
                self._finish(r)
        return outs

    def _finish(self, r: _Req) -> None:
        del self._reqs[r.rid]
        for end in range(self.page_size, len(r.prompt) + 1, self.page_size):
            self._cached.add((r.namespace, tuple(r.prompt[:end])))

    def stats(self) -> FakeStats:
        in_use = sum(
            math.ceil((len(r.prompt) + len(r.out)) / self.page_size) for r in self._reqs.values()
        )
        evictable = len(self._cached)
        return FakeStats(
            running=len(self._reqs),
            waiting=0,
            num_pages=self.num_pages,
            page_size=self.page_size,
            pages_free=self.num_pages - in_use - evictable,
            pages_evictable=evictable,
            pages_in_use=in_use,
            prompt_tokens_total=self._prompt_total,
            cached_prompt_tokens_total=self._hit_total,
            aborted_total=self._aborted,
            hit_rate=self._hit_total / max(1, self._prompt_total),
        )

    def flush_cache(self) -> bool:
        if self._reqs:
            return False
        self._cached.clear()
        return True

    def check_invariants(self) -> None:
        s = self.stats()
        assert s.pages_free + s.pages_evictable + s.pages_in_use == s.num_pages
