"""Beam search on ``/v1/completions`` and ``/v1/chat/completions`` (vLLM's
``use_beam_search``, with ``n`` beams and ``length_penalty``), as vLLM's server runs it:
outside the engine, as one-token greedy generations that ask for their ``2 n`` likeliest
next tokens. A chat's prompt is its messages rendered as the router renders them for a
generation (``Gateway.tokenize_chat``).

Each step asks one generation per live beam, its prompt the beam's tokens so far. A
beam's prompt is its parent's and one token more, so the radix cache holds all of it but
the last page's tokens: a step recomputes at most a page per beam, however long the
prompt, and beams that share a prefix share its pages. Each beam's candidates are its
likeliest continuations; a candidate ending in an end-of-sequence token (unless
``ignore_eos``) is finished, and the ``n`` best of the others by score go on. At the end
the ``n`` best of the finished and the live are returned, best first. A sequence's score
is vLLM's: its cumulative logprob over its length (prompt included, a final
end-of-sequence token not) to the power ``length_penalty``.

Sampling parameters (temperature, top-p, penalties) do not apply, as in vLLM; a request's
``stop`` strings, structured output, logprobs, echo, streaming and (on chat) tools to call
and predicted outputs are refused. A chat's beams are read by the server's reasoning parser
as any answer is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.sampling_params import SamplingParams
from radixserve.serving.http import chat_tools
from radixserve.serving.http.errors import invalid
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.http.openai_protocol import ChatCompletionRequest, CompletionRequest

# The likeliest next tokens of a prompt: (token id, logprob), best first.
NextTokens = Callable[[list[int]], Awaitable[list[tuple[int, float]]]]


@dataclass(frozen=True)
class Beam:
    """A sequence (prompt and output tokens), its output's cumulative logprob, and whether
    an end-of-sequence token finished it."""

    tokens: list[int]
    logprob: float
    finished: bool = False

    def score(self, length_penalty: float) -> float:
        """vLLM's ``get_beam_search_score``."""
        length = len(self.tokens) - (1 if self.finished else 0)
        return self.logprob / (length**length_penalty)


async def beam_search(
    next_tokens: NextTokens,
    prompt: Sequence[int],
    width: int,
    max_tokens: int,
    eos_token_ids: Sequence[int],
    length_penalty: float = 1.0,
) -> list[Beam]:
    """The ``width`` best sequences continuing ``prompt`` by up to ``max_tokens`` tokens,
    best first (``eos_token_ids``: the tokens that finish a beam; none with ignore_eos)."""
    eos = set(eos_token_ids)
    live = [Beam(list(prompt), 0.0)]
    finished: list[Beam] = []

    def key(b: Beam) -> float:
        return b.score(length_penalty)

    for _ in range(max_tokens):
        tops = await asyncio.gather(*(next_tokens(b.tokens) for b in live))
        going: list[Beam] = []
        for beam, top in zip(live, tops):
            for token, logprob in top:
                child = Beam(beam.tokens + [token], beam.logprob + logprob, token in eos)
                (finished if child.finished else going).append(child)
        live = sorted(going, key=key, reverse=True)[:width]
        if not live:
            break
    return sorted(finished + live, key=key, reverse=True)[:width]


async def search(
    g: Gateway,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[str | list[int]],
    max_tokens: int | None,
    salt: str | None,
    lora: str | None,
) -> list[Searched]:
    """Each prompt's ids, its ``n`` best beams (:mod:`~.beam_search`) and their texts;
    ``max_tokens`` None: as many as the context leaves each prompt."""
    arrival = time.monotonic()
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * body.n, ignore_eos=True)

    async def next_tokens(tokens: list[int]) -> list[tuple[int, float]]:
        f = await g.generate(
            arrival=arrival, input_ids=tokens, params=step, cache_salt=salt, lora=lora
        )
        assert f.logprobs, "a logprobs request answered without them"
        return list(f.logprobs[0].top)

    info = await g.info()
    eos = [] if body.ignore_eos else info.eos_token_ids

    async def one(pr: str | list[int]) -> Searched:
        ids = pr if isinstance(pr, list) else (await g.tokenize([pr]))[0]
        most = info.context_length - len(ids) if max_tokens is None else max_tokens
        if most < 1 or len(ids) + most > info.context_length:
            raise invalid(
                f"the prompt's {len(ids)} tokens and max_tokens {most} exceed the "
                f"context of {info.context_length} tokens",
                param="max_tokens",
            )
        beams = await beam_search(next_tokens, ids, body.n, most, eos, body.length_penalty)
        texts = [await g.detokenize(_output(b, len(ids))) for b in beams]
        return Searched(ids, beams, texts)

    return list(await asyncio.gather(*(one(pr) for pr in prompts)))


@dataclass(frozen=True)
class Searched:
    """A prompt's ids, its best beams, best first, and their output texts."""

    prompt: list[int]
    beams: list[Beam]
    texts: list[str]

    def finish_reason(self, k: int) -> str:
        return "stop" if self.beams[k].finished else "length"

    def output(self, k: int) -> list[int]:
        """Beam ``k``'s output tokens (a final end-of-sequence token included, as counted)."""
        return self.beams[k].tokens[len(self.prompt) :]


def _output(beam: Beam, prompt_len: int) -> list[int]:
    """A beam's output tokens, without the end-of-sequence token that finished it."""
    return beam.tokens[prompt_len : len(beam.tokens) - (1 if beam.finished else 0)]


def reply(searched: list[Searched], rid: str, model: str, ids: bool) -> dict[str, Any]:
    """The completion ``rid`` of beam-searched prompts: each prompt's beams as its ``n``
    choices."""
    choices: list[dict[str, Any]] = []
    for found in searched:
        for k, text in enumerate(found.texts):
            choice: dict[str, Any] = {
                "index": len(choices),
                "text": text,
                "logprobs": None,
                "finish_reason": found.finish_reason(k),
                "stop_reason": None,
            }
            if ids:  # vLLM's return_token_ids
                choice |= {"prompt_token_ids": found.prompt, "token_ids": found.output(k)}
            choices.append(choice)
    return _answer(rid, "text_completion", model, choices, searched)


def chat_reply(
    found: Searched, rid: str, model: str, tools: chat_tools.ToolPlan, ids: bool
) -> dict[str, Any]:
    """The chat completion ``rid`` of a beam-searched chat: its beams as the ``n`` choices,
    each message read as any answer is (``tools``: the reasoning parser, no calls)."""
    choices: list[dict[str, Any]] = []
    for k, text in enumerate(found.texts):
        message, finish_reason = chat_tools.message(tools, text, found.finish_reason(k))
        choice = {
            "index": k,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        if ids:  # vLLM's return_token_ids
            choice["token_ids"] = found.output(k)
        choices.append(choice)
    out = _answer(rid, "chat.completion", model, choices, [found])
    if ids:
        out["prompt_token_ids"] = found.prompt
    return out


def _answer(
    rid: str, kind: str, model: str, choices: list[dict[str, Any]], searched: list[Searched]
) -> dict[str, Any]:
    prompt_tokens = sum(len(found.prompt) for found in searched)
    completion_tokens = sum(
        len(found.output(k)) for found in searched for k in range(len(found.beams))
    )
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "system_fingerprint": None,
    }
