"""LoRA adapters through HTTP, on the shared server (its adapter ``sql``): picked by the
OpenAI ``model`` (vLLM's way), ``base:adapter`` or ``lora_path`` (SGLang's), each answer
PEFT's adapted model's, and the base model's beside it unchanged."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from engine_helpers import hf_greedy, peft_greedy, random_prompts

N = 6


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def server_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def completion_ids(client: openai.OpenAI, model: str, prompt: list[int], **extra: Any) -> list[int]:
    out = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=N,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **extra},
    )
    assert out.model == (server_name(client) if model == "default" else model)
    return out.choices[0].model_extra["token_ids"]


def test_adapter_named_as_the_model_answers_as_peft(
    client: openai.OpenAI, server: Any, tiny_lora_dir: Any
) -> None:
    prompt = random_prompts([13], seed=21)[0]
    ref = peft_greedy(server.model_dir, tiny_lora_dir, prompt, N)
    assert ref != hf_greedy(server.model_dir, prompt, N)
    assert completion_ids(client, "sql", prompt) == ref
    assert completion_ids(client, f"{server.model_dir.name}:sql", prompt) == ref
    assert completion_ids(client, "default", prompt, lora_path="sql") == ref
    # The base model's answer, after the adapter's requests cached the same prompt.
    assert completion_ids(client, "default", prompt) == hf_greedy(server.model_dir, prompt, N)


def test_chat_and_stream_with_an_adapter(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "Name a table."}]
    kw: Any = {"messages": msgs, "max_tokens": 6, "temperature": 0}
    extra = {"ignore_eos": True}
    whole = client.chat.completions.create(model="sql", extra_body=extra, **kw)
    assert whole.model == "sql"
    base = client.chat.completions.create(model="default", extra_body=extra, **kw)
    assert whole.choices[0].message.content != base.choices[0].message.content
    chunks = client.chat.completions.create(model="sql", stream=True, extra_body=extra, **kw)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_sglang_generate_lora_path_per_prompt(server: Any, tiny_lora_dir: Any) -> None:
    prompts = random_prompts([7, 9], seed=22)
    body = {
        "input_ids": prompts,
        "lora_path": [None, "sql"],
        "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True},
    }
    out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert out[0]["output_ids"] == hf_greedy(server.model_dir, prompts[0], N)
    assert out[1]["output_ids"] == peft_greedy(server.model_dir, tiny_lora_dir, prompts[1], N)


def test_adapters_not_served_are_refused(client: openai.OpenAI, server: Any) -> None:
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.NotFoundError, match="no LoRA adapter 'nope'"):
        client.completions.create(
            model="default", prompt="x", max_tokens=1, extra_body={"lora_path": "nope"}
        )
    with pytest.raises(openai.BadRequestError, match="lora_path"):
        client.completions.create(
            model="sql", prompt="x", max_tokens=1, extra_body={"lora_path": "other"}
        )
    body = {"text": "x", "lora_path": "nope", "sampling_params": {"max_new_tokens": 1}}
    reply = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert reply.status_code == 400 and "unknown LoRA adapter 'nope'" in reply.text
