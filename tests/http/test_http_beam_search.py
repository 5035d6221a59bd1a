"""Beam search on /v1/completions and /v1/chat/completions (vLLM's ``use_beam_search``)
through the ``openai`` client, on the shared server: with no end-of-sequence token in play,
its ``n`` beams are transformers' own beam search's ``n`` sequences, best first (a chat's
from its messages as the server renders them); what it does not run with is a 400, and so
is ``length_penalty`` without it."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import torch
from engine_helpers import hf_model, random_prompts

N, WIDTH = 5, 3


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def hf_beams(model_dir: Any, prompt: list[int]) -> list[list[int]]:
    out = hf_model(model_dir).generate(
        input_ids=torch.tensor([prompt]),
        num_beams=WIDTH,
        num_return_sequences=WIDTH,
        max_new_tokens=N,
        min_new_tokens=N,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [row[len(prompt) :].tolist() for row in out]


def test_beams_are_transformers_beams(client: openai.OpenAI, server: Any) -> None:
    prompts = random_prompts([8, 13], seed=71)
    out = client.completions.create(
        model="default",
        prompt=prompts,
        max_tokens=N,
        n=WIDTH,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True},
    )
    assert [c.index for c in out.choices] == list(range(2 * WIDTH))
    for k, prompt in enumerate(prompts):
        got = [c.model_extra["token_ids"] for c in out.choices[k * WIDTH : (k + 1) * WIDTH]]
        assert got == hf_beams(server.model_dir, prompt)
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 2 * WIDTH * N


@pytest.mark.parametrize(
    ("extra", "kw", "match"),
    [
        ({"use_beam_search": True}, {"stream": True}, "stream is not supported with beam"),
        ({"use_beam_search": True}, {"logprobs": 2}, "logprobs is not supported with beam"),
        ({"use_beam_search": True}, {"stop": ["x"]}, "stop is not supported with beam"),
        ({"use_beam_search": True}, {"n": 11}, r"n in \[1, 10\]"),
        ({"length_penalty": 0.5}, {}, "length_penalty applies to beam search"),
    ],
)
def test_what_beam_search_does_not_run_with(
    client: openai.OpenAI, extra: dict[str, Any], kw: dict[str, Any], match: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=match):
        client.completions.create(model="default", prompt="x", max_tokens=2, extra_body=extra, **kw)


def test_a_chats_beams_are_transformers_beams_from_its_rendered_prompt(
    client: openai.OpenAI, server: Any
) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    with server.client() as c:
        rendered = c.post("/tokenize", json={"model": "default", "messages": messages}).json()
    out = client.chat.completions.create(
        model="default",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=N,
        n=WIDTH,
        extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True},
    )
    assert out.object == "chat.completion"
    assert out.model_extra["prompt_token_ids"] == rendered["tokens"]
    got = [ch.model_extra["token_ids"] for ch in out.choices]
    assert got == hf_beams(server.model_dir, rendered["tokens"])
    with server.client() as c:
        texts = [c.post("/detokenize", json={"tokens": ids}).json()["prompt"] for ids in got]
    assert [ch.message.content for ch in out.choices] == texts
    assert [ch.finish_reason for ch in out.choices] == ["length"] * WIDTH
    assert out.usage.prompt_tokens == rendered["count"]
    assert out.usage.completion_tokens == WIDTH * N


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"stream": True}, "stream is not supported with beam"),
        ({"logprobs": True}, "logprobs is not supported with beam"),
        ({"stop": ["x"]}, "stop is not supported with beam"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools is not supported"),
        ({"n": 11}, r"n in \[1, 10\]"),
    ],
)
def test_what_a_chats_beam_search_does_not_run_with(
    client: openai.OpenAI, kw: dict[str, Any], match: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"use_beam_search": True},
            **kw,
        )
