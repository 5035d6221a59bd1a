"""``logit_bias`` through the HTTP APIs: the ``openai`` client's chat and completions, and
SGLang's native ``/generate`` (token id strings as keys, as both send them)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

pytestmark = pytest.mark.slow  # a real server process

FORCED = 300


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_logit_bias_forces_and_bans(client: openai.OpenAI, tokenizer: Any) -> None:
    msgs: Any = [{"role": "user", "content": "Say something."}]
    kw: dict[str, Any] = dict(model="default", messages=msgs, max_tokens=4, temperature=0.0)
    forced = client.chat.completions.create(
        **kw, logit_bias={str(FORCED): 100}, extra_body={"ignore_eos": True}
    )
    assert forced.choices[0].message.content == tokenizer.decode([FORCED] * 4)
    # n > 1 with a seed: every sampled choice takes the bias.
    sampled = client.completions.create(
        model="default",
        prompt="abc",
        max_tokens=3,
        temperature=1.0,
        n=2,
        seed=1,
        logit_bias={str(FORCED): 100},
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in sampled.choices] == [tokenizer.decode([FORCED] * 3)] * 2
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(**kw, logit_bias={str(FORCED): 101})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(**kw, logit_bias={"not-a-token": 1})
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.chat.completions.create(**kw, logit_bias={str(10**9): 1})


def test_sglang_generate_logit_bias(server: Any) -> None:
    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    with server.client() as c:
        plain = c.post("/generate", json={"text": "abc", "sampling_params": params}).json()
        banned = c.post(
            "/generate",
            json={
                "text": "abc",
                "sampling_params": {**params, "logit_bias": {str(plain["output_ids"][0]): -100.0}},
            },
        ).json()
        assert banned["output_ids"][0] != plain["output_ids"][0]
        bad = c.post(
            "/generate",
            json={"text": "abc", "sampling_params": {**params, "logit_bias": {"1": 1e9}}},
        )
        assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]
