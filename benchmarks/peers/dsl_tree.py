"""The fork/tree workload: a ``frontend_dsl`` program run against any OpenAI-compatible peer.

The program (tree-of-thought-like): a shared system prompt, a question, a short plan;
then ``fork(branches)``: each branch develops one approach, and forks again into a
strength and a weakness; the branches join and a verdict follows. Every call's prompt
extends its parent's prompt + answer, so the tree's shared prefixes are what a prefix
cache can reuse: 1 + b + 2b + 1 calls per program.

:class:`OpenAIBackend` is a DSL :class:`~frontend_dsl.backend.Backend` over HTTP
(``/v1/completions``, streaming): it tokenizes each prompt with the model's tokenizer
and sends the *token ids* (so every peer sees identical tokens), records each call's
prompt ids, answer ids, TTFT, chunk gaps and the peer's usage, from which the bench
computes throughput, latency percentiles, the measured hit rate and the optimum
(:func:`benchmarks.workloads.optimal_hit_rate` over the calls in issue order, with each
call's prompt + answer cacheable). Peers that only take text prompts get text.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from frontend_dsl import assistant, gen, program, system, user
from frontend_dsl.backend import (
    Backend,
    CallUsage,
    GenChunk,
    GenStream,
    ModelInfo,
    ScoreRequest,
    ScoreResult,
)
from radixserve.sampling_params import SamplingParams

from .openai_load import usage_of

TREE_SYSTEM = (
    "You are a careful problem solver. For every question you first sketch a plan, then explore "
    "several approaches in depth, weigh each approach's strengths and weaknesses honestly, and finally "
    "choose the best approach with a one-sentence justification. Keep every answer short and concrete."
)
TREE_QUESTIONS = [
    "How can a small town reduce traffic in its centre?",
    "How should a student prepare for a maths exam?",
    "How can a bakery sell fewer leftover loaves?",
    "How can a team shorten its weekly meetings?",
    "How can a library attract more teenagers?",
    "How can a runner avoid injuries?",
    "How can a family cut its electricity bill?",
    "How can a school garden survive the summer holidays?",
    "How can a museum make queues shorter?",
    "How can a new cook learn knife skills safely?",
    "How can a choir learn a difficult piece faster?",
    "How can a cyclist commute in winter?",
    "How can a village keep its only shop open?",
    "How can a programmer review code faster?",
    "How can a farmer save water?",
    "How can a city park feel safer at night?",
]


@program
def tree_of_thought(
    s: Any,
    tag: str,
    question: str,
    branches: int,
    plan_tokens: int,
    thought_tokens: int,
    eval_tokens: int,
) -> None:
    s += system(tag + TREE_SYSTEM)
    s += user(question)
    s += assistant("Plan: " + gen("plan", max_tokens=plan_tokens))
    forks = s.fork(branches)
    for i, f in enumerate(forks):
        f += user(f"Develop approach number {i + 1} in detail.")
        f += assistant(gen("thought", max_tokens=thought_tokens))
        sub = f.fork(2)
        for j, g in enumerate(sub):
            g += user("Name its main strength." if j == 0 else "Name its main weakness.")
            g += assistant(gen("eval", max_tokens=eval_tokens))
        sub.join()
    forks.join()
    s += user("Which approach is best, and why?")
    s += assistant(gen("verdict", max_tokens=plan_tokens))


class _HTTPStream(GenStream):
    def __init__(self, backend: OpenAIBackend, prompt: str, params: SamplingParams) -> None:
        self._b, self._prompt, self._params = backend, prompt, params
        self._closed = False

    def __iter__(self) -> Iterator[GenChunk]:
        b = self._b
        ids = b.tokenizer.encode(self._prompt, add_special_tokens=False)
        body: dict[str, Any] = {
            "model": b.model,
            "max_tokens": self._params.max_tokens,
            "temperature": 0.0,
            "stream": True,
            **b.extra_body,
        }
        body["prompt"] = ids if b.mode == "ids" else self._prompt
        if b.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self._params.stop:
            body["stop"] = list(self._params.stop)
        t0 = time.perf_counter()
        stamps: list[float] = []
        text, usage, finish, error = "", None, None, None
        try:
            with b.client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(
                        f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:300]}"
                    )
                for line in resp.iter_lines():
                    if self._closed:
                        break
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    ev = json.loads(data)
                    usage = usage_of(ev) or usage
                    for ch in ev.get("choices") or []:
                        if ch.get("text"):
                            stamps.append(time.perf_counter())
                            text += ch["text"]
                            yield GenChunk(text=ch["text"])
                        finish = ch.get("finish_reason") or finish
        except Exception as exc:  # noqa: BLE001 - reported on the chunk and the record
            error = f"{type(exc).__name__}: {exc}"
        end = time.perf_counter()
        answer_ids = b.tokenizer.encode(text, add_special_tokens=False) if text else []
        prompt_n = usage[0] if usage else len(ids)
        completion_n = usage[2] if usage and usage[2] else len(answer_ids)
        cached = usage[1] if usage else None
        b.record(
            {
                "start": t0,
                "ttft": (stamps[0] - t0) if stamps else end - t0,
                "e2e": end - t0,
                "itl": [y - x for x, y in zip(stamps, stamps[1:])],
                "prompt_ids": ids,
                "answer_ids": answer_ids,
                "prompt_tokens": prompt_n,
                "completion_tokens": completion_n,
                "cached_tokens": cached,
                "error": error,
            }
        )
        yield GenChunk(
            finished=True,
            finish_reason="error" if error else (finish or "stop"),
            error=error,
            usage=CallUsage(prompt_n, cached or 0, completion_n),
        )

    def close(self) -> None:
        self._closed = True


class OpenAIBackend(Backend):
    """A DSL backend over an OpenAI-compatible ``/v1/completions`` endpoint (greedy)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer: Any,
        *,
        chat_template: str | None,
        mode: str = "ids",
        extra_body: dict[str, Any] | None = None,
        include_usage: bool = True,
        connections: int = 64,
        timeout_s: float = 600.0,
    ) -> None:
        self.model, self.tokenizer, self.mode = model, tokenizer, mode
        self.extra_body = dict(extra_body or {})
        self.include_usage = include_usage
        self.client = httpx.Client(
            base_url=base_url,
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        )
        self._info = ModelInfo(
            model=model,
            chat_template=chat_template,
            special_tokens={
                k: v
                for k, v in {
                    "bos_token": tokenizer.bos_token,
                    "eos_token": tokenizer.eos_token,
                }.items()
                if v
            },
            vocab_size=len(tokenizer),
        )
        self._lock = threading.Lock()
        self.calls: list[dict[str, Any]] = []

    def record(self, call: dict[str, Any]) -> None:
        with self._lock:
            self.calls.append(call)

    def model_info(self) -> ModelInfo:
        return self._info

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def generate(
        self, prompt: str, params: SamplingParams, *, program_id: str | None = None
    ) -> GenStream:
        return _HTTPStream(self, prompt, params)

    def score(
        self, requests: list[ScoreRequest], *, program_id: str | None = None
    ) -> list[ScoreResult]:
        raise NotImplementedError("the tree workload does not use select()")

    def close(self) -> None:
        self.client.close()


def run_tree(
    backend: OpenAIBackend,
    programs: int,
    concurrency: int,
    *,
    salt: int,
    branches: int = 4,
    plan_tokens: int = 32,
    thought_tokens: int = 48,
    eval_tokens: int = 24,
) -> tuple[list[Any], float]:
    """Run ``programs`` tree programs, ``concurrency`` at a time; returns the states and wall time."""
    batch = [
        {
            "tag": f"[run {salt % 100000:05d}] ",
            "question": TREE_QUESTIONS[i % len(TREE_QUESTIONS)]
            + ("" if i < len(TREE_QUESTIONS) else f" (variant {i})"),
            "branches": branches,
            "plan_tokens": plan_tokens,
            "thought_tokens": thought_tokens,
            "eval_tokens": eval_tokens,
        }
        for i in range(programs)
    ]
    t0 = time.perf_counter()
    states = tree_of_thought.run_batch(
        batch, backend=backend, concurrency=concurrency, defaults={"temperature": 0.0}, warmup=False
    )
    return states, time.perf_counter() - t0
