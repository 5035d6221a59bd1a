"""OpenAI's ``/v1/embeddings`` on the shared server, through the ``openai`` client: each
vector is transformers' final hidden state at the prompt's last token, scaled to unit
length (PEFT's adapted model's for a LoRA adapter); base64 and float encodings agree;
``dimensions`` truncates before scaling; inputs sharing a prefix reuse its cache; bad
inputs are 4xx."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from engine_helpers import hf_last_hidden, random_prompts


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def last_hidden(model_dir: Path, prompt: list[int], adapter: Path | None = None) -> list[float]:
    """transformers' final-norm output at the prompt's last token (PEFT's adapted model's,
    merged into a fresh copy, with ``adapter``)."""
    model = None
    if adapter is not None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    return hf_last_hidden(model_dir, prompt, model).tolist()


def unit(v: list[float]) -> list[float]:
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def close(a: list[float], b: list[float], tol: float = 2e-4) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


def test_vectors_are_the_last_tokens_hidden_states(client: openai.OpenAI, server: Any) -> None:
    prompts = random_prompts([7, 12, 3], seed=41)
    out = client.embeddings.create(model="default", input=prompts)  # base64 on the wire
    assert [d.index for d in out.data] == [0, 1, 2]
    assert out.usage.prompt_tokens == out.usage.total_tokens == 22
    for p, d in zip(prompts, out.data):
        assert close(d.embedding, unit(last_hidden(server.model_dir, p)))
    floats = client.embeddings.create(model="default", input=prompts[0], encoding_format="float")
    assert close(floats.data[0].embedding, out.data[0].embedding, 1e-6)
    short = client.embeddings.create(model="default", input=prompts[1], dimensions=8)
    raw = last_hidden(server.model_dir, prompts[1])
    assert close(short.data[0].embedding, unit(raw[:8]))
    unscaled = client.embeddings.create(
        model="default", input=prompts[1], extra_body={"normalize": False}
    )
    assert close(unscaled.data[0].embedding, raw)


def test_text_inputs_and_a_shared_prefix(client: openai.OpenAI, server: Any) -> None:
    """A text embeds as its tokens do; an input that extends one embedded before reads the
    prefix from the cache, and its vector is still the whole prompt's."""
    text = "Retrieval starts from a question about kernels"
    for special in (True, False):
        ids = httpx.post(
            server.url + "/tokenize",
            json={"prompt": text, "add_special_tokens": special},
            timeout=30,
        ).json()["tokens"]
        by_text = client.embeddings.create(
            model="default", input=text, extra_body={"add_special_tokens": special}
        )
        by_ids = client.embeddings.create(model="default", input=ids)
        assert by_text.usage.prompt_tokens == len(ids)
        assert close(by_text.data[0].embedding, by_ids.data[0].embedding)
    head = random_prompts([40], seed=42)[0]
    client.embeddings.create(model="default", input=head)
    longer = head + [5, 6, 7]
    out = client.embeddings.create(model="default", input=longer)
    assert out.usage.model_extra["prompt_tokens_details"] == {"cached_tokens": 40}  # 10 pages
    assert close(out.data[0].embedding, unit(last_hidden(server.model_dir, longer)))


def test_an_adapters_vectors_are_its_own(
    client: openai.OpenAI, server: Any, tiny_lora_dir: Path
) -> None:
    prompt = random_prompts([9], seed=43)[0]
    adapted = client.embeddings.create(model="sql", input=prompt).data[0].embedding
    assert close(adapted, unit(last_hidden(server.model_dir, prompt, tiny_lora_dir)))
    base = client.embeddings.create(model="default", input=prompt).data[0].embedding
    assert not close(adapted, base)


def test_bad_inputs_are_refused(client: openai.OpenAI) -> None:
    for kw, match in [
        ({"input": []}, "input must not be empty"),
        ({"input": ["x", ""]}, r"input\[1\] is empty"),
        ({"input": "x", "dimensions": 100000}, "dimensions must be at most"),
        ({"input": [[1, 2], [-1]]}, "input"),
        ({"input": "x", "extra_body": {"pooling": "mean"}}, "pooling"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match):
            client.embeddings.create(model="default", encoding_format="float", **kw)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")


def test_sglangs_encode_answers_the_same_vectors(client: openai.OpenAI, server: Any) -> None:
    prompts = random_prompts([6, 9], seed=43)
    ref = client.embeddings.create(model="default", input=prompts, encoding_format="float")
    with server.client() as c:
        one = c.post("/encode", json={"input_ids": prompts[0], "rid": "e1"}).json()
        both = c.post("/encode", json={"input_ids": prompts, "dimensions": 8}).json()
        text = c.post("/encode", json={"text": "hello there"}).json()
        bad = [
            c.post("/encode", json=body)
            for body in ({"text": "x", "image_data": "y"}, {}, {"input_ids": [[1], []]})
        ]
    assert close(one["embedding"], ref.data[0].embedding, 1e-6)
    assert one["meta_info"]["id"] == "e1" and one["meta_info"]["prompt_tokens"] == 6
    assert [len(x["embedding"]) for x in both] == [8, 8]
    assert close(both[1]["embedding"], unit(last_hidden(server.model_dir, prompts[1])[:8]))
    plain = client.embeddings.create(model="default", input="hello there", encoding_format="float")
    assert close(text["embedding"], plain.data[0].embedding, 1e-6)
    assert [r.status_code for r in bad] == [400, 400, 400]
