"""``/v1/messages`` through the real ``anthropic`` SDK against ``radixserve serve``.

The same server as the Responses tests (``agent_server``: tiny random Llama, Qwen3's
template, two API keys sent as ``x-api-key``). Checked: a forced ``tool_use`` (``any``),
its ``tool_result`` answered on the next turn with the previous prompt read from the cache
(``cache_read_input_tokens``); the streamed events through the SDK's stream reader with a
named tool; ``stop_sequences`` and ``stop_reason``; errors in Anthropic's shape, from the
handlers and from the key check and body limit before them.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from http_helpers import AGENT_KEYS, Server

PAGE = 4
TOOLS: Any = [
    {
        "name": "get_weather",
        "description": "Current weather of a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
    {
        "name": "get_time",
        "description": "Current time in a time zone",
        "input_schema": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
]
# This SDK version has no sampling arguments; the server takes them (older SDKs send them).
GREEDY: Any = {"temperature": 0}
SYSTEM = "You are a helpful assistant. Use the tools."


def sdk(srv: Server, key: str = AGENT_KEYS[0]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0)


def check_input(block: Any) -> None:
    assert block.type == "tool_use" and block.id
    if block.name == "get_weather":
        assert set(block.input) == {"city"} and len(block.input["city"]) <= 12
    else:
        assert block.name == "get_time" and block.input["zone"] in ("UTC", "CET")


def test_tool_use_then_tool_result(agent_server: Server) -> None:
    client = sdk(agent_server)
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    m1 = client.messages.create(
        model="default",
        system=SYSTEM,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},  # exactly one call
        max_tokens=200,
        extra_body=GREEDY,
    )
    assert m1.stop_reason == "tool_use" and m1.id.startswith("msg_") and m1.role == "assistant"
    (use,) = [b for b in m1.content if b.type == "tool_use"]
    check_input(use)
    assert not [b for b in m1.content if b.type == "text"]  # no markup as text
    prompt1 = m1.usage.input_tokens + (m1.usage.cache_read_input_tokens or 0)
    messages.append({"role": "assistant", "content": [b.model_dump() for b in m1.content]})
    messages.append(
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}],
        }
    )
    m2 = client.messages.create(
        model="default",
        system=SYSTEM,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "none"},
        max_tokens=4,
        extra_body=GREEDY,
    )
    assert m2.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in m2.content)
    assert m2.usage.output_tokens <= 4
    cached = m2.usage.cache_read_input_tokens or 0
    assert cached >= (prompt1 // PAGE) * PAGE - PAGE, (m1.usage, m2.usage)


def test_streamed_tool_use_through_the_sdk_stream_reader(agent_server: Server) -> None:
    with sdk(agent_server).messages.stream(
        model="default",
        messages=[{"role": "user", "content": "Time in Berlin?"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_time"},
        max_tokens=200,
        extra_body=GREEDY,
    ) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds and kinds.count("content_block_start") == 1
    (use,) = final.content
    assert use.name == "get_time"
    check_input(use)
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0


def test_stop_sequences_and_stop_reason(agent_server: Server) -> None:
    client = sdk(agent_server)
    msgs: Any = [{"role": "user", "content": "Count with me"}]
    free = client.messages.create(model="default", messages=msgs, max_tokens=12, extra_body=GREEDY)
    text = "".join(b.text for b in free.content if b.type == "text")
    assert free.stop_reason in ("end_turn", "max_tokens")
    if len(text) < 6:
        pytest.skip(f"the random model's answer is too short to cut: {text!r}")
    stop = text[4:6]
    cut = client.messages.create(
        model="default",
        messages=msgs,
        max_tokens=12,
        extra_body=GREEDY,
        stop_sequences=["@@@", stop],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    cut_text = "".join(b.text for b in cut.content if b.type == "text")
    assert stop not in cut_text and text.startswith(cut_text)
    streamed = "".join(
        client.messages.stream(
            model="default", messages=msgs, max_tokens=12, extra_body=GREEDY, stop_sequences=[stop]
        )
        .__enter__()
        .text_stream
    )
    assert streamed == cut_text


def test_errors_in_anthropic_shape(agent_server: Server) -> None:
    client = sdk(agent_server)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model="default",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                }
            ],
        )
    body: Any = bad.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError) as auth:
        sdk(agent_server, "wrong-key").messages.create(
            model="default", max_tokens=1, messages=[{"role": "user", "content": "x"}]
        )
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="nope", max_tokens=1, messages=[{"role": "user", "content": "x"}]
        )
    headers = {"x-api-key": AGENT_KEYS[0]}
    with httpx.Client(base_url=agent_server.url, headers=headers, timeout=60) as c:
        for payload in (
            {"model": "default", "messages": [{"role": "user", "content": "x"}]},  # no max_tokens
            {"model": "default", "max_tokens": 1, "messages": [{"role": "robot", "content": "x"}]},
            {"model": "default", "max_tokens": 1, "messages": [], "tools": "x"},
            {
                "model": "default",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "tool"},
            },
        ):
            r = c.post("/v1/messages", json=payload)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (
                r.text
            )
        big = c.post("/v1/messages", content=json.dumps({"model": "default", "x": "y" * (5 << 20)}))
        assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"


def test_thinking_switch_reaches_the_template(agent_server: Server) -> None:
    """``thinking: disabled`` is Qwen3's ``enable_thinking: false``: the template closes an
    empty think block in the prompt (it grows), and the answer has no thinking block."""
    client = sdk(agent_server)
    msgs: Any = [{"role": "user", "content": "Hi"}]
    on = client.messages.create(model="default", messages=msgs, max_tokens=2, extra_body=GREEDY)
    off = client.messages.create(
        model="default",
        messages=msgs,
        max_tokens=2,
        extra_body=GREEDY,
        thinking={"type": "disabled"},
    )

    def prompt(m: Any) -> int:
        return int(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0))

    assert prompt(off) > prompt(on)
    assert all(b.type != "thinking" for b in off.content)
    # A budget travels to the engine as thinking_token_budget; this model has no <think>
    # token, so no block opens and the answer is the one without a budget.
    budgeted = client.messages.create(
        model="default",
        messages=msgs,
        max_tokens=2,
        extra_body=GREEDY,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert budgeted.content == on.content and prompt(budgeted) == prompt(on)


def test_output_config_json_schema_is_constrained(agent_server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"mood": {"enum": ["calm", "busy"]}},
        "required": ["mood"],
        "additionalProperties": False,
    }
    m = sdk(agent_server).messages.create(
        model="default",
        messages=[{"role": "user", "content": "Mood?"}],
        max_tokens=60,
        extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    (block,) = m.content
    assert block.type == "text" and json.loads(block.text)["mood"] in ("calm", "busy")
    assert m.stop_reason == "end_turn"


def test_count_tokens_is_the_prompt_a_request_sends(agent_server: Server) -> None:
    """``messages.count_tokens`` through the SDK gives the prompt the same body sends to
    ``/v1/messages`` (its usage: computed plus read from the cache): with a system prompt,
    tools and a tool round trip, and with thinking off (the template renders more)."""
    client = sdk(agent_server)
    turns: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "9C"}],
        },
    ]
    for extra in ({}, {"thinking": {"type": "disabled"}}):
        body: Any = {
            "model": "default",
            "system": SYSTEM,
            "tools": TOOLS,
            "messages": turns,
            **extra,
        }
        counted = client.messages.count_tokens(**body).input_tokens
        sent = client.messages.create(max_tokens=1, extra_body=GREEDY, **body).usage
        assert counted == sent.input_tokens + (sent.cache_read_input_tokens or 0) > 0
    bare = client.messages.count_tokens(model="default", messages=turns[:1]).input_tokens
    assert bare < counted
    with agent_server.client(headers={"x-api-key": AGENT_KEYS[0]}) as c:
        r = c.post("/v1/messages/count_tokens", json={"model": "default", "messages": []})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        r = c.post("/v1/messages/count_tokens", json={"model": "nope", "messages": turns[:1]})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    with agent_server.client() as c:  # no key
        r = c.post("/v1/messages/count_tokens", json={"model": "default", "messages": turns[:1]})
        assert r.status_code == 401 and r.json()["type"] == "error"


def test_a_final_assistant_message_is_prefilled(agent_server: Server) -> None:
    """Anthropic's prefill: a final assistant message is the start of the reply, and the
    answer holds what the model adds to it: the same tokens as the chat API continuing the
    same messages (``continue_final_message``); an empty one counts as none."""
    client = sdk(agent_server)
    start = "The weather in Paris is"
    turns: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": start},
    ]
    body: Any = {"model": "default", "system": SYSTEM, "messages": turns}
    m = client.messages.create(max_tokens=6, extra_body=GREEDY, **body)
    prompt = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert client.messages.count_tokens(**body).input_tokens == prompt
    plain = client.messages.count_tokens(model="default", system=SYSTEM, messages=turns[:1])
    assert prompt > plain.input_tokens
    empty = [turns[0], {"role": "assistant", "content": ""}]
    assert client.messages.count_tokens(model="default", system=SYSTEM, messages=empty) == plain
    chat = openai.OpenAI(base_url=agent_server.url + "/v1", api_key=AGENT_KEYS[0], max_retries=0)
    same = chat.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": SYSTEM}, *turns],
        max_tokens=6,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert same.usage is not None and same.usage.prompt_tokens == prompt
    text = "".join(b.text for b in m.content if b.type == "text")
    assert text == same.choices[0].message.content and text


def test_the_models_api_answers_both_sdks(agent_server: Server) -> None:
    """``/v1/models`` in both shapes at once: the anthropic SDK's ``models.list`` and
    ``models.retrieve`` read the served model (its name, its start time), the openai SDK's
    the same; an unknown model is a 404 to both."""
    a = sdk(agent_server)
    page = a.models.list()
    (card,) = page.data
    assert card.type == "model" and card.display_name == card.id
    assert not page.has_more and page.first_id == page.last_id == card.id
    assert a.models.retrieve(card.id) == card
    o = openai.OpenAI(base_url=agent_server.url + "/v1", api_key=AGENT_KEYS[0], max_retries=0)
    (listed,) = o.models.list().data
    assert listed.id == card.id and listed.created == int(card.created_at.timestamp())
    assert o.models.retrieve(card.id).id == card.id
    with pytest.raises(anthropic.NotFoundError):
        a.models.retrieve("no-such-model")
    with pytest.raises(openai.NotFoundError):
        o.models.retrieve("no-such-model")
