"""Scoring the choices of ``select`` from prompt logprobs.

The tokenization boundary is where such scoring usually goes wrong: ``tokenize(prompt)
+ tokenize(choice)`` is not ``tokenize(prompt + choice)`` (``"Answer:" + " yes"`` may
tokenize to ``["Answer", ":", " yes"]`` while ``"Answer: " + "yes"`` merges the space
into the choice's first token). So each choice is tokenized *jointly* with the prompt,
and every choice is scored from one position: the first where any choice's ids stop
agreeing with the tokenized prompt. Everything from there on — occasionally a
re-tokenized piece of the prompt's tail — is scored, and nothing before it, so the
choices are compared over the same text (a choice that would leave the prompt's trailing
space as a token of its own pays for it like one that merges it), and the cached prefix
is exactly shared.

One batched ``Backend.score`` call scores all choices. When the prompt's tail is new
to the backend (not yet part of any earlier call of the program), the first choice goes
alone first so the engine computes and caches the shared prefix once; the others then
find it in the radix cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from frontend_dsl.backend import Backend, CallUsage, ScoreRequest, ScoreResult
from radixserve.prefix import common_prefix_len

__all__ = ["SelectResult", "common_prefix_len", "plan_choice_requests", "pick", "score_choices"]


@dataclass(frozen=True)
class SelectResult:
    """The chosen index and the evidence: per-choice scores and token logprobs.

    A dataclass, not a NamedTuple: a field named ``index`` would hide ``tuple.index``."""

    index: int
    choice: str
    scores: list[float]  # the method's score of each choice
    token_logprobs: list[list[float]]  # logprobs of each choice's scored tokens
    boundaries: list[int]  # first scored token position of each choice
    usage: CallUsage


def plan_choice_requests(prompt_ids: list[int], joint_ids: list[list[int]]) -> list[ScoreRequest]:
    """One ``ScoreRequest`` per choice, all scoring from the first position where any
    choice's tokens differ from the prompt's (so that their scores are comparable)."""
    agree = [common_prefix_len(prompt_ids, ids) for ids in joint_ids]
    if any(n >= len(ids) for n, ids in zip(agree, joint_ids)):
        raise ValueError("a select choice adds no tokens to the prompt (empty choice?)")
    # Position 0 has no logprob (nothing precedes it): score from 1 at the earliest.
    start = max(min(agree, default=1), 1)
    return [ScoreRequest(token_ids=list(ids), start=start) for ids in joint_ids]


def pick(
    token_logprobs: list[list[float]], method: str | Callable[[list[list[float]]], int]
) -> tuple[int, list[float]]:
    """Choose an index by ``method``; return it with each choice's score."""
    if callable(method):
        index = int(method(token_logprobs))
        if not 0 <= index < len(token_logprobs):
            raise ValueError(
                f"select method returned index {index} for {len(token_logprobs)} choices"
            )
        return index, [float("nan")] * len(token_logprobs)
    if method == "mean":
        scores = [sum(lp) / len(lp) for lp in token_logprobs]
    elif method == "sum":
        scores = [float(sum(lp)) for lp in token_logprobs]
    elif method == "first":
        scores = [lp[0] for lp in token_logprobs]
    else:
        raise ValueError(f"unknown select method {method!r}")
    # Ties go to the earlier choice (max returns the first maximal element).
    index = max(range(len(scores)), key=lambda i: scores[i])
    return index, scores


def _sum_usage(results: Sequence[ScoreResult]) -> CallUsage:
    return CallUsage(
        prompt_tokens=sum(r.usage.prompt_tokens for r in results),
        cached_tokens=sum(r.usage.cached_tokens for r in results),
        completion_tokens=sum(r.usage.completion_tokens for r in results),
    )


def score_choices(
    backend: Backend,
    prompt: str,
    choices: Sequence[str],
    method: str | Callable[[list[list[float]]], int] = "mean",
    *,
    program_id: str | None = None,
    prefix_is_cached: bool = False,
) -> SelectResult:
    """Score ``choices`` as continuations of ``prompt`` and pick one.

    ``prefix_is_cached``: the whole prompt was already part of an earlier call, so all
    choices can go in one request batch without a warm-up.
    """
    ids = backend.tokenize([prompt] + [prompt + c for c in choices])
    requests = plan_choice_requests(ids[0], ids[1:])
    if prefix_is_cached or len(requests) == 1:
        results = backend.score(requests, program_id=program_id)
    else:
        results = backend.score(requests[:1], program_id=program_id)
        results += backend.score(requests[1:], program_id=program_id)
    if len(results) != len(requests):
        raise RuntimeError(f"backend returned {len(results)} scores for {len(requests)} choices")
    token_logprobs = [list(r.logprobs) for r in results]
    for req, lp in zip(requests, token_logprobs):
        if len(lp) != len(req.token_ids) - req.start:
            raise RuntimeError(
                f"backend returned {len(lp)} prompt logprobs, expected {len(req.token_ids) - req.start}"
            )
    index, scores = pick(token_logprobs, method)
    return SelectResult(
        index=index,
        choice=choices[index],
        scores=scores,
        token_logprobs=token_logprobs,
        boundaries=[r.start for r in requests],
        usage=_sum_usage(results),
    )
