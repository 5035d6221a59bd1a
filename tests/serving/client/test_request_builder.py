"""The one request builder both clients use: what each keyword becomes on the wire, and a
keyword neither client knows failing as any unknown keyword does."""

from __future__ import annotations

import inspect

import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import AsyncClient, Client
from radixserve.serving.client.common import GenerateOptions, generate_request
from radixserve.serving.wire import protocol as p


def test_options_become_the_request_fields() -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0)
    req = generate_request(
        "r1",
        None,
        True,
        {
            "messages": [{"role": "user", "content": "hi"}],
            "params": params,
            "session_id": "s",
            "namespace": "tenant",
            "add_generation_prompt": False,
            "continue_final_message": True,
            "cache_salt": "salt",
            "prediction": "hi there",
        },
    )
    assert req == p.GenerateRequest(
        request_id="r1",
        messages=[p.ChatMessage(role="user", content="hi")],
        add_generation_prompt=False,
        continue_final_message=True,
        params=params,
        stream=True,
        session_id="s",
        namespace="tenant",
        cache_salt="salt",
        prediction="hi there",
    )
    # It round-trips the wire as the router decodes it.
    assert p.decode_client(p.encode(req)) == req


def test_defaults_match_the_protocol_defaults() -> None:
    req = generate_request("r2", "hello", False, {})
    assert req.text == "hello" and req.add_generation_prompt and req.params == SamplingParams()
    assert req.input_ids is None and req.messages is None and not req.stream


def test_an_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="max_tokens"):
        generate_request("r3", "hello", False, {"max_tokens": 3})  # type: ignore[typeddict-unknown-key]


def test_both_clients_take_the_same_options() -> None:
    """The clients' generate methods declare the options once, through GenerateOptions."""
    for method in (Client.submit, AsyncClient.stream):
        kinds = {n: prm.kind for n, prm in inspect.signature(method).parameters.items()}
        assert kinds["options"] is inspect.Parameter.VAR_KEYWORD
    assert set(GenerateOptions.__optional_keys__) == {
        "input_ids",
        "messages",
        "params",
        "session_id",
        "namespace",
        "add_generation_prompt",
        "continue_final_message",
        "cache_salt",
        "priority",
        "tools",
        "chat_template_kwargs",
        "prediction",
        "lora",
        "chat_template",
    }
