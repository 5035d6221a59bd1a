"""Beam search on ``/v1/completions`` (vLLM's ``use_beam_search``, with ``n`` beams and
``length_penalty``), as vLLM's server runs it: outside the engine, as one-token greedy
generations that ask for their ``2 n`` likeliest next tokens.

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
``stop`` strings, structured output, logprobs, echo and streaming are refused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.sampling_params import SamplingParams
from radixserve.serving.http.errors import invalid
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.http.openai_protocol import CompletionRequest

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
    body: CompletionRequest,
    prompts: list[str | list[int]],
    max_tokens: int,
    salt: str | None,
    lora: str | None,
) -> list[tuple[list[int], list[Beam], list[str]]]:
    """Each prompt's ids, its ``n`` best beams (:mod:`~.beam_search`) and their texts."""
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

    async def one(pr: str | list[int]) -> tuple[list[int], list[Beam], list[str]]:
        ids = pr if isinstance(pr, list) else (await g.tokenize([pr]))[0]
        if len(ids) + max_tokens > info.context_length:
            raise invalid(
                f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} exceed the "
                f"context of {info.context_length} tokens",
                param="max_tokens",
            )
        beams = await beam_search(next_tokens, ids, body.n, max_tokens, eos, body.length_penalty)
        texts = [await g.detokenize(_output(b, len(ids))) for b in beams]
        return ids, beams, texts

    return list(await asyncio.gather(*(one(pr) for pr in prompts)))


def _output(beam: Beam, prompt_len: int) -> list[int]:
    """A beam's output tokens, without the end-of-sequence token that finished it."""
    return beam.tokens[prompt_len : len(beam.tokens) - (1 if beam.finished else 0)]


def reply(
    searched: list[tuple[list[int], list[Beam], list[str]]], rid: str, model: str, ids: bool
) -> dict[str, Any]:
    """The completion ``rid`` of beam-searched prompts: each prompt's beams as its ``n``
    choices."""
    choices: list[dict[str, Any]] = []
    prompt_tokens = completion_tokens = 0
    for prompt, beams, texts in searched:
        prompt_tokens += len(prompt)
        for beam, text in zip(beams, texts):
            output = beam.tokens[len(prompt) :]
            completion_tokens += len(output)
            choice: dict[str, Any] = {
                "index": len(choices),
                "text": text,
                "logprobs": None,
                "finish_reason": "stop" if beam.finished else "length",
                "stop_reason": None,
            }
            if ids:  # vLLM's return_token_ids
                choice |= {"prompt_token_ids": prompt, "token_ids": output}
            choices.append(choice)
    return {
        "id": rid,
        "object": "text_completion",
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
