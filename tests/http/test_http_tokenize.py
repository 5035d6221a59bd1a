"""vLLM's ``/tokenize`` and ``/detokenize`` against ``radixserve serve``: the counts are the
prompts the generation routes send (their usage) and transformers' own encoding."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from http_helpers import Server

from radixserve.serving.client import Client, ServerError

CHAT: Any = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def _post(c: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _templated(tokenizer: Any, add_generation_prompt: bool) -> list[int]:
    """transformers' ids of CHAT through the model's template."""
    out = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def test_a_prompt_counts_as_a_completion_sends_it(server: Server, tokenizer: Any) -> None:
    prompt = "The radix tree keeps every prefix once."
    with server.client() as c:
        out = _post(
            c, "/tokenize", {"model": "default", "prompt": prompt, "return_token_strs": True}
        )
        assert out["tokens"] == tokenizer.encode(prompt) and out["count"] == len(out["tokens"])
        assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
        assert out["max_model_len"] == c.get("/v1/models").json()["data"][0]["max_model_len"]
        sent = _post(c, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 1})
        assert sent["usage"]["prompt_tokens"] == out["count"]
        bare = _post(c, "/tokenize", {"prompt": prompt, "add_special_tokens": False})
        assert bare["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
        assert bare["token_strs"] is None


def test_messages_count_as_a_chat_completion_sends_them(server: Server, tokenizer: Any) -> None:
    with server.client() as c:
        out = _post(c, "/tokenize", {"messages": CHAT})
        assert out["tokens"] == _templated(tokenizer, add_generation_prompt=True)
        sent = _post(
            c, "/v1/chat/completions", {"model": "default", "messages": CHAT, "max_tokens": 1}
        )
        assert sent["usage"]["prompt_tokens"] == out["count"]
        open_ = _post(c, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
        assert open_["tokens"] == _templated(tokenizer, add_generation_prompt=False)
        assert open_["count"] < out["count"]


def test_detokenize_gives_the_text_back(server: Server, tokenizer: Any) -> None:
    text = "Pages are shared, never copied."
    with server.client() as c:
        ids = _post(c, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        assert _post(c, "/detokenize", {"model": "default", "tokens": ids})["prompt"] == text
        assert _post(c, "/detokenize", {"tokens": []})["prompt"] == ""


def test_a_gateway_without_the_tokenizer_uses_the_routers(server: Server, tokenizer: Any) -> None:
    """A gateway started on its own, with no --tokenizer, still decodes (by the router) and
    names the special tokens: what lm-evaluation-harness's remote tokenizer needs of
    ``/tokenizer_info``, ``/tokenize`` and ``/detokenize``."""
    from radixserve.serving.http.gateway import GatewayConfig
    from radixserve.serving.http.server import HTTPGateway

    config = GatewayConfig(router=server.endpoint, memory_log_interval_s=0)
    http = HTTPGateway(config, "127.0.0.1", 0).start()
    try:
        with httpx.Client(base_url=http.url, timeout=60) as c:
            info = c.get("/tokenizer_info").json()
            assert info["eos_token"] == tokenizer.eos_token
            assert info["chat_template"] == tokenizer.chat_template
            assert info["model_max_length"] > 0 and info["vocab_size"] >= len(tokenizer)
            text = "Pages are shared, never copied."
            ids = _post(c, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
            assert _post(c, "/detokenize", {"tokens": ids})["prompt"] == text
            with_bos = tokenizer.encode(text)
            assert _post(c, "/detokenize", {"tokens": with_bos})["prompt"] == tokenizer.decode(
                with_bos
            )
            assert c.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    finally:
        http.stop()
    with Client(server.endpoint, timeout=60) as client:  # the router's own check
        assert client.detokenize(with_bos, skip_special_tokens=True) == text
        with pytest.raises(ServerError, match=r"invalid_params.*tokenizer's vocabulary"):
            client.detokenize([len(tokenizer)])


def test_bad_bodies_are_400s(server: Server) -> None:
    with server.client() as c:
        bad: list[tuple[str, Any]] = [
            ("/tokenize", {"prompt": "a", "messages": CHAT}),
            ("/tokenize", {}),
            ("/tokenize", {"messages": []}),
            ("/tokenize", {"messages": CHAT, "continue_final_message": True}),
            ("/tokenize", {"messages": CHAT, "add_special_tokens": True}),
            ("/tokenize", {"prompt": 5}),
            ("/detokenize", {"tokens": [10**9]}),
            ("/detokenize", {"tokens": [-1]}),
            ("/detokenize", {"tokens": ["1"]}),
            ("/detokenize", {"tokens": [1] * 100_000}),
        ]
        for path, body in bad:
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error", r.text
        r = c.post("/tokenize", json={"model": "nope", "prompt": "a"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_prefilled_reply_is_continued(server: Server) -> None:
    """``continue_final_message``: the last message is the start of the reply; the answer is
    what the model writes after it, the same greedy tokens as generating from the ids
    ``/tokenize`` gives for the same messages."""
    chat = [*CHAT, {"role": "assistant", "content": "My favourite colour is"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    with server.client() as c:
        ids = _post(c, "/tokenize", {"messages": chat, **flags})["tokens"]
        closed = _post(c, "/tokenize", {"messages": chat, "add_generation_prompt": False})
        assert ids == closed["tokens"][: len(ids)] and len(ids) < closed["count"]
        body = {"model": "default", "messages": chat, "max_tokens": 6, "temperature": 0}
        out = _post(c, "/v1/chat/completions", {**body, **flags})
        assert out["usage"]["prompt_tokens"] == len(ids)
        sampling = {"max_new_tokens": 6, "temperature": 0}
        ref = _post(c, "/generate", {"input_ids": ids, "sampling_params": sampling})
        assert out["choices"][0]["message"]["content"] == ref["text"]
        r = c.post("/v1/chat/completions", json={**body, "continue_final_message": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
