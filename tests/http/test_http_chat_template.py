"""A request's own chat template (vLLM's ``chat_template``) through HTTP: the shared server
takes them (``--trust-request-chat-template``), and a chat completion's prompt and
``/tokenize``'s count are that template's rendering; a gateway without the flag refuses it
with a 400, and ``chat_template_kwargs`` cannot bring one in."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from radixserve.serving.http.gateway import GatewayConfig
from radixserve.serving.http.server import HTTPGateway

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ '<reply>' }}"
CHAT: Any = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def untrusting(server: Any, tokenizer: Any) -> Iterator[str]:
    """A gateway with the default limits in front of the shared server's router."""
    config = GatewayConfig(router=server.endpoint, memory_log_interval_s=0)
    http = HTTPGateway(config, "127.0.0.1", 0, tokenizer=tokenizer).start()
    try:
        yield http.url
    finally:
        http.stop()


def test_the_requests_template_renders_the_prompt(server: Any) -> None:
    rendered = "<system>Be short.<user>Hi!<reply>"
    want = httpx.post(
        server.url + "/tokenize",
        json={"prompt": rendered, "add_special_tokens": False},
        timeout=30,
    ).json()["tokens"]
    counted = httpx.post(
        server.url + "/tokenize", json={"messages": CHAT, "chat_template": TEMPLATE}, timeout=30
    ).json()["tokens"]
    assert counted == want
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model="default",
        messages=CHAT,
        max_tokens=2,
        extra_body={"chat_template": TEMPLATE, "return_token_ids": True},
    )
    assert out.model_extra["prompt_token_ids"] == want  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="may not set chat_template"):
        client.chat.completions.create(
            model="default",
            messages=CHAT,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"chat_template": TEMPLATE}},
        )


def test_a_server_without_the_flag_refuses_it(untrusting: str) -> None:
    client = openai.OpenAI(base_url=untrusting + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="trust-request-chat-template") as exc:
        client.chat.completions.create(
            model="default", messages=CHAT, max_tokens=2, extra_body={"chat_template": TEMPLATE}
        )
    assert exc.value.body["param"] == "chat_template"  # type: ignore[index]
    reply = httpx.post(
        untrusting + "/tokenize", json={"messages": CHAT, "chat_template": TEMPLATE}, timeout=30
    )
    assert reply.status_code == 400 and "trust-request-chat-template" in reply.text
