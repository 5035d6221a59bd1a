"""Classification on a ``serve`` process of a tiny three-label Qwen3ForSequenceClassification:
vLLM's ``/v1/classify`` (probs = softmax of transformers' logits, the argmax's label) by
token ids, text and a chat, SGLang's reward ``/classify`` (the raw logits as
``embedding``), a cached prefix giving the same scores; generation refused, bad bodies 400s,
and a server of a causal LM refusing to classify."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_helpers import hf_class_logits, random_prompts
from http_helpers import Server, serve, stop

LABELS = ("negative", "neutral", "positive")


@pytest.fixture(scope="module")
def classifier(tiny_classifier_dir: Path) -> Iterator[Server]:
    srv = serve(tiny_classifier_dir)
    yield srv
    stop(srv)


@pytest.fixture(scope="module")
def http(classifier: Server) -> Iterator[httpx.Client]:
    with classifier.client() as c:
        yield c


def close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want, atol=2e-4, rtol=2e-4)


def check_entry(entry: dict[str, Any], model_dir: Path, prompt: list[int]) -> None:
    logits = hf_class_logits(model_dir, prompt)
    close(entry["probs"], torch.softmax(logits, -1))
    assert entry["label"] == LABELS[int(logits.argmax())]
    assert entry["num_classes"] == 3


def tokens(http: httpx.Client, text: str, special: bool = True) -> list[int]:
    body = {"prompt": text, "add_special_tokens": special}
    return http.post("/tokenize", json=body).json()["tokens"]


def test_vllm_shape(http: httpx.Client, classifier: Server) -> None:
    """A batch of token-id inputs, then a text, on both of vLLM's paths."""
    prompts = random_prompts([7, 12, 5], seed=71)
    r = http.post("/v1/classify", json={"model": "default", "input": prompts})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"].startswith("classify-") and out["object"] == "list"
    assert isinstance(out["created"], int) and out["model"]
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    for d, p in zip(out["data"], prompts):
        check_entry(d, classifier.model_dir, p)
    usage = out["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == 24
    assert usage["completion_tokens"] == 0 and "cached_tokens" in usage["prompt_tokens_details"]
    text = "The kernels were fast and the cache was warm"
    one = http.post("/classify", json={"model": "default", "input": text}).json()
    assert len(one["data"]) == 1
    check_entry(one["data"][0], classifier.model_dir, tokens(http, text))


def test_a_chat_is_rendered_without_a_generation_prompt(
    http: httpx.Client, classifier: Server
) -> None:
    from transformers import AutoTokenizer

    chat = [
        {"role": "user", "content": "Is the sky blue?"},
        {"role": "assistant", "content": "Yes, on a clear day."},
    ]
    tok = AutoTokenizer.from_pretrained(str(classifier.model_dir))
    text = tok.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    r = http.post("/v1/classify", json={"model": "default", "messages": chat})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    check_entry(r.json()["data"][0], classifier.model_dir, ids)


def test_sglang_reward_route(http: httpx.Client, classifier: Server) -> None:
    """SGLang's ``text`` batch answers each input's raw logits; a longer prompt over the same
    head reads it from the cache and still scores as transformers does."""
    texts = ["A long shared instruction about rating answers, then answer one", "Short"]
    r = http.post("/classify", json={"model": "default", "text": texts})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 2
    for item, t in zip(out, texts):
        close(item["embedding"], hf_class_logits(classifier.model_dir, tokens(http, t)))
        assert item["meta_info"]["prompt_tokens"] == len(tokens(http, t))
    longer = tokens(http, texts[0]) + [40, 41, 42]
    warm = http.post("/v1/classify", json={"input_ids": longer}).json()
    assert warm["meta_info"]["cached_tokens"] > 0
    close(warm["embedding"], hf_class_logits(classifier.model_dir, longer))


def test_generation_and_embedding_scores_refused(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 400
    assert "sequence classifier" in r.text
    r = http.post("/v1/score", json={"model": "default", "text_1": "a", "text_2": "b"})
    assert r.status_code == 400 and "/v1/classify" in r.text, r.text


@pytest.mark.parametrize(
    "body",
    [
        {"input": ""},
        {"input": []},
        {"input": [[]]},
        {"input": 5},
        {"input": [1.5]},
        {"input": [[1, 2]] * 2049},
        {"input": "a", "messages": [{"role": "user", "content": "b"}]},
        {},
        {"input": "a", "temperature": 0.5},
        {"text": ""},
        {"text": "a", "input_ids": [1]},
        {"text": 5},
        {"text": "a", "lora_path": "sql"},
    ],
)
def test_bad_bodies(http: httpx.Client, body: dict[str, Any]) -> None:
    r = http.post("/classify", json=body)
    assert r.status_code == 400, (body, r.text)


def test_bad_json_and_an_unknown_model(http: httpx.Client) -> None:
    assert http.post("/v1/classify", content=b"{not json").status_code == 400
    assert http.post("/v1/classify", json=[1, 2]).status_code == 400
    assert http.post("/v1/classify", json={"input": "a", "model": "other"}).status_code == 404


def test_a_causal_lm_does_not_classify(server: Server) -> None:
    with server.client() as c:
        for path, body in [("/v1/classify", {"input": "x"}), ("/classify", {"text": "x"})]:
            r = c.post(path, json=body)
            assert r.status_code == 400 and "not a sequence classifier" in r.text, r.text
