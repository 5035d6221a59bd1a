"""``/v1/responses`` through the real ``openai`` SDK against ``radixserve serve``.

The server (``agent_server``) runs the tiny random Llama with Qwen3's chat template, so a
call is forced with ``tool_choice`` (a random model writes none on its own). Checked: the
tool loop (function_call -> function_call_output -> answer) continued with
``previous_response_id``, its ``cached_tokens`` covering the previous turn's prompt and
its turn finding the previous one's session lease (the chain's session key); the
same conversation resent as items renders the same prompt; the streamed event sequence
through the SDK's own stream reader; the store's tenancy and ``store: false``; retrieving
and deleting stored responses; malformed
items and unsupported fields answered with a 400 (never a 500), and the body limit.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest
from http_helpers import AGENT_KEYS, Server, wait_idle

PAGE = 4  # ENGINE_FLAGS' page size
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "Current time in a time zone",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
    },
}
TOOLS: Any = [WEATHER, TIME]
INSTRUCTIONS = "You are a helpful assistant. Use the tools."


def sdk(srv: Server, key: str = AGENT_KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def args_of(call: Any) -> dict[str, Any]:
    args = json.loads(call.arguments)
    if call.name == "get_weather":
        assert set(args) == {"city"} and len(args["city"]) <= 12
    else:
        assert call.name == "get_time" and args["zone"] in ("UTC", "CET")
    return args


def _lease_hits(srv: Server) -> int:
    """Session-lease hits summed over the workers (a turn that found its session's lease)."""
    r = httpx.get(
        srv.url + "/get_server_info", headers={"Authorization": f"Bearer {AGENT_KEYS[0]}"}
    )
    return sum(w["engine"]["lease_hits_total"] for w in r.json()["workers"] if w["alive"])


def test_tool_loop_continued_by_previous_response_id(agent_server: Server) -> None:
    client = sdk(agent_server)
    common: Any = {
        "model": "default",
        "instructions": INSTRUCTIONS,
        "tools": TOOLS,
        "temperature": 0,
    }
    r1 = client.responses.create(
        **common,
        input="Weather in Paris?",
        tool_choice="required",
        parallel_tool_calls=False,  # exactly one call (the structural tag's single-call form)
        max_output_tokens=200,
    )
    assert r1.status == "completed" and r1.id.startswith("resp_")
    (call,) = [o for o in r1.output if o.type == "function_call"]
    args_of(call)
    assert not r1.output_text  # no markup leaks into a message
    assert r1.usage is not None and r1.usage.input_tokens > 0
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    hits = _lease_hits(agent_server)
    r2 = client.responses.create(
        **common,
        previous_response_id=r1.id,
        input=[result],
        tool_choice="none",
        max_output_tokens=6,
    )
    assert r2.status in ("completed", "incomplete") and r2.previous_response_id == r1.id
    assert [o.type for o in r2.output] == ["message"] and isinstance(r2.output_text, str)
    assert r2.usage is not None
    cached = r2.usage.input_tokens_details.cached_tokens
    # The continued prompt starts with the whole previous prompt (whole pages of it cached).
    assert cached >= (r1.usage.input_tokens // PAGE) * PAGE - PAGE, (r1.usage, r2.usage)
    assert r2.usage.input_tokens > r1.usage.input_tokens
    # previous_response_id is the session key (r1's id): r1's turn leased its path, r2 found it.
    assert _lease_hits(agent_server) == hits + 1
    # The same conversation resent as items (no server state) renders the same prompt.
    items: Any = [{"role": "user", "content": "Weather in Paris?"}]
    items += [o.model_dump(exclude_none=True) for o in r1.output] + [result]
    r3 = client.responses.create(
        **common, input=items, tool_choice="none", max_output_tokens=1, store=False
    )
    assert r3.usage is not None and r3.usage.input_tokens == r2.usage.input_tokens
    assert r3.usage.input_tokens_details.cached_tokens >= cached


def test_required_with_parallel_calls_gives_valid_calls(agent_server: Server) -> None:
    """``required`` with parallel calls on (the default): one or more calls, each a known
    tool with schema-valid arguments, the same constraint as chat completions apply."""
    r = sdk(agent_server).responses.create(
        model="default",
        instructions=INSTRUCTIONS,
        tools=TOOLS,
        temperature=0,
        input="Weather in Paris and the time in CET?",
        tool_choice="required",
        max_output_tokens=300,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    # A random model may keep calling until max_output_tokens ("incomplete"): every call it
    # finished is still a known tool with valid arguments.
    assert r.status in ("completed", "incomplete") and calls, r.output
    if r.status == "completed":
        assert not r.output_text
    for call in calls:
        args_of(call)


def test_streamed_call_through_the_sdk_stream_reader(agent_server: Server) -> None:
    client = sdk(agent_server)
    with client.responses.stream(
        model="default",
        input="Time in Berlin?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=200,
        temperature=0,
    ) as stream:
        seen = [ev for ev in stream]
        final = stream.get_final_response()
    kinds = [ev.type for ev in seen]
    assert [ev.sequence_number for ev in seen] == list(range(len(seen)))
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [ev.delta for ev in seen if ev.type == "response.function_call_arguments.delta"]
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_time"
    assert "".join(deltas) == call.arguments and args_of(call)
    assert final.usage is not None and final.usage.output_tokens > 0


def test_streamed_text_and_incomplete_status(agent_server: Server) -> None:
    events = list(
        sdk(agent_server).responses.create(
            model="default", input="Hello", max_output_tokens=5, temperature=0, stream=True
        )
    )
    kinds = [ev.type for ev in events]
    text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    last: Any = events[-1]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.content_part.added" in kinds and "response.output_text.done" in kinds
    assert last.response.output[0].content[0].text == text
    if last.response.usage.output_tokens == 5:
        assert last.type == "response.incomplete"
        assert last.response.incomplete_details.reason == "max_output_tokens"


def test_store_is_per_tenant_and_store_false_keeps_nothing(agent_server: Server) -> None:
    a, b = sdk(agent_server, AGENT_KEYS[0]), sdk(agent_server, AGENT_KEYS[1])
    kept = a.responses.create(model="default", input="Hi", max_output_tokens=1)
    gone = a.responses.create(
        model="default",
        input="Hi",
        max_output_tokens=1,
        store=False,
        include=["reasoning.encrypted_content"],  # what a stateless client (Codex) asks
    )
    a.responses.create(
        model="default", input="Again", previous_response_id=kept.id, max_output_tokens=1
    )
    for client, rid in [(b, kept.id), (a, gone.id), (a, "resp_unknown")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(
                model="default", input="x", previous_response_id=rid, max_output_tokens=1
            )
        assert err.value.code == "previous_response_not_found"


def test_a_stored_response_is_retrieved_and_deleted(agent_server: Server) -> None:
    """``responses.retrieve`` gives back the response as it was answered, streamed or not,
    to its own tenant only; ``responses.delete`` forgets it: neither retrieved nor
    continued after; ``store: false`` keeps nothing to retrieve."""
    a, b = sdk(agent_server, AGENT_KEYS[0]), sdk(agent_server, AGENT_KEYS[1])
    made = a.responses.create(model="default", input="Hi", max_output_tokens=2)
    got = a.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    events = a.responses.create(model="default", input="Hey", max_output_tokens=2, stream=True)
    (streamed,) = [ev.response for ev in events if ev.type == "response.incomplete"]
    assert a.responses.retrieve(streamed.id).model_dump() == streamed.model_dump()
    unstored = a.responses.create(model="default", input="Hi", max_output_tokens=1, store=False)
    for client, rid in [(b, made.id), (a, unstored.id), (a, "resp_unknown")]:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(made.id)  # not b's to delete
    a.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError) as err:
        a.responses.create(
            model="default", input="x", previous_response_id=made.id, max_output_tokens=1
        )
    assert err.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        a.responses.delete(made.id)


def _ended(client: openai.OpenAI, rid: str, timeout_s: float = 60.0) -> Any:
    """The background response once it is no longer in progress (polled, as its clients do)."""
    deadline = time.monotonic() + timeout_s
    while (got := client.responses.retrieve(rid)).status == "in_progress":
        assert time.monotonic() < deadline, f"{rid} still in progress after {timeout_s} s"
        time.sleep(0.05)
    return got


def test_a_background_response_is_answered_at_once_and_polled(agent_server: Server) -> None:
    a = sdk(agent_server)
    kw: Any = dict(model="default", input="Tell me a story", max_output_tokens=6, temperature=0)
    now = a.responses.create(background=True, **kw)
    assert now.status == "in_progress" and now.background is True and now.output == []
    done = _ended(a, now.id)
    assert done.status in ("completed", "incomplete") and done.usage is not None
    direct = a.responses.create(**kw)
    assert done.output_text == direct.output_text and done.output_text
    # It ended: a conversation goes on from it.
    more = a.responses.create(previous_response_id=done.id, **kw)
    assert more.usage is not None and more.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError):
        a.responses.create(background=True, store=False, **kw)
    with pytest.raises(openai.BadRequestError, match="not streamed in the background"):
        a.responses.retrieve(done.id, stream=True)


def test_a_streamed_background_response_is_picked_up_again_where_it_was_left(
    agent_server: Server,
) -> None:
    """A client reads a few events and drops the connection; the response goes on, and the
    stream is picked up again after the last event it read (``starting_after``), the
    numbers following on; after the end, the whole stream is read again from the start."""
    a = sdk(agent_server)
    kw: Any = dict(model="default", input="Tell me a story", max_output_tokens=24, temperature=0)
    with a.responses.create(background=True, stream=True, **kw) as dropped:
        events = iter(dropped)
        seen = [next(events) for _ in range(4)]
    assert [e.type for e in seen[:2]] == ["response.created", "response.in_progress"]
    rid = seen[0].response.id  # type: ignore[union-attr]
    last = seen[-1].sequence_number
    rest = list(a.responses.retrieve(rid, stream=True, starting_after=last))
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(numbers)))
    end = rest[-1]
    assert end.type in ("response.completed", "response.incomplete")
    direct = a.responses.create(**kw)
    assert end.response.output_text == direct.output_text  # type: ignore[union-attr]
    assert a.responses.retrieve(rid).status == end.response.status  # type: ignore[union-attr]
    again = list(a.responses.retrieve(rid, stream=True))
    assert [e.type for e in again] == [e.type for e in seen + rest]
    a.responses.delete(rid)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(rid, stream=True)
    # Cancelled while a reader follows it: that reader's stream ends there.
    with a.responses.create(background=True, stream=True, **{**kw, "max_output_tokens": 1500}) as s:
        events = iter(s)
        long = next(events).response.id  # type: ignore[union-attr]
        assert a.responses.cancel(long).status == "cancelled"
        tail = [e.type for e in events]
    assert tail and not {"response.completed", "response.incomplete"} & set(tail)


def test_a_background_response_is_cancelled(agent_server: Server) -> None:
    a, b = sdk(agent_server, AGENT_KEYS[0]), sdk(agent_server, AGENT_KEYS[1])
    kw: Any = dict(model="default", input="Count to a thousand", temperature=0)
    long = a.responses.create(background=True, max_output_tokens=1500, **kw)
    with pytest.raises(openai.BadRequestError, match="still in progress"):
        a.responses.create(previous_response_id=long.id, max_output_tokens=1, **kw)
    with pytest.raises(openai.NotFoundError):
        b.responses.cancel(long.id)  # not b's
    with agent_server.client(headers={"Authorization": f"Bearer {AGENT_KEYS[0]}"}) as c:
        aborted_before = c.get("/get_server_info").json()["workers"][0]["engine"]["aborted_total"]
        cancelled = a.responses.cancel(long.id)
        after = wait_idle(c)["workers"][0]["engine"]  # its KV freed: no page in use
    assert after["aborted_total"] == aborted_before + 1 and after["invariants"] == "ok"
    assert cancelled.status == "cancelled" and cancelled.output == []
    assert a.responses.retrieve(long.id).status == "cancelled"
    assert a.responses.cancel(long.id).status == "cancelled"  # again: as it is
    direct = a.responses.create(max_output_tokens=1, **kw)
    with pytest.raises(openai.BadRequestError, match="Only a background response"):
        a.responses.cancel(direct.id)


def test_input_items_list_what_the_model_was_given(agent_server: Server) -> None:
    """``responses.input_items.list``: a response's input items, newest first by default,
    with the ids a client gave kept and stable ids for the rest (so pages follow each other
    with ``after``); a continued response lists the earlier turn's items and output too;
    another tenant's, a deleted or an unknown response is a 404, a bad page a 400."""
    a, b = sdk(agent_server, AGENT_KEYS[0]), sdk(agent_server, AGENT_KEYS[1])
    given: Any = [
        {"role": "developer", "content": "Answer briefly."},
        {"id": "msg_mine", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]
    first = a.responses.create(model="default", input=given, max_output_tokens=2)
    newest = a.responses.input_items.list(first.id)
    assert [i.type for i in newest.data] == ["message", "message"]
    assert [i.role for i in newest.data] == ["user", "developer"]  # type: ignore[union-attr]
    assert newest.data[0].id == "msg_mine" and newest.data[1].id.startswith("msg_")
    assert [c.text for c in newest.data[1].content] == ["Answer briefly."]  # type: ignore[union-attr]
    again = a.responses.input_items.list(first.id, order="asc")
    assert [i.id for i in again.data] == [i.id for i in reversed(newest.data)]  # stable ids
    second = a.responses.create(
        model="default", input="And now?", previous_response_id=first.id, max_output_tokens=2
    )
    paged = list(a.responses.input_items.list(second.id, order="asc", limit=1))  # page by page
    ids = [i.id for i in paged]
    assert ids[:2] == [i.id for i in again.data]
    assert ids[2 : 2 + len(first.output)] == [o.id for o in first.output]
    assert len(ids) == 3 + len(first.output) and len(set(ids)) == len(ids)
    assert paged[-1].content[0].text == "And now?"  # type: ignore[union-attr]
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "msg_nothing"}):
        with pytest.raises(openai.BadRequestError):
            a.responses.input_items.list(first.id, **bad)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        b.responses.input_items.list(first.id)
    a.responses.delete(first.id)
    for rid in (first.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            a.responses.input_items.list(rid)


BAD: list[tuple[str, Any]] = [
    ("input", [{"type": "function_call", "name": "get_time"}]),  # no call_id / arguments
    ("input", [{"type": "function_call", "call_id": "c", "name": "x", "arguments": "[1]"}]),
    ("input", [{"type": "function_call_output", "output": "x"}]),
    ("input", [{"type": "input_image", "image_url": "http://x"}]),
    ("input", [{"role": "robot", "content": "x"}]),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    ("input", [1]),
    ("input", 5),
    ("input", []),
    ("tools", [{"type": "web_search"}]),
    ("tools", [{"type": "function", "name": "bad name!"}]),
    ("tool_choice", {"type": "allowed_tools", "tools": []}),
    ("text", {"format": {"type": "grammar"}}),
    ("reasoning", {"effort": "high"}),
    ("background", "yes"),
    ("truncation", "auto"),
    ("max_output_tokens", 0),
    ("thinking_token_budget", -1),
    ("include", ["message.output_text.logprobs"]),
    ("include", "reasoning.encrypted_content"),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_malformed_requests_are_400(agent_server: Server, field: str, value: Any) -> None:
    body = {"model": "default", "input": "x", "max_output_tokens": 1, field: value}
    with agent_server.client(headers={"Authorization": f"Bearer {AGENT_KEYS[0]}"}) as c:
        r = c.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_an_effort_the_template_would_ignore_is_400_on_both_apis(agent_server: Server) -> None:
    """Qwen3's template does not read reasoning_effort: handed to it, the effort would change
    nothing, so chat completions and Responses both say so (tests/http/test_http_units.py
    has a template that reads it)."""
    bodies = {
        "/v1/chat/completions": (
            {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low"},
            "reasoning_effort",
        ),
        "/v1/responses": ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning.effort"),
    }
    with agent_server.client(headers={"Authorization": f"Bearer {AGENT_KEYS[0]}"}) as c:
        for path, (body, param) in bodies.items():
            r = c.post(path, json={"model": "default", "max_tokens": 1, **body})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and "does not read reasoning_effort" in error["message"]


def test_request_size_limit_checked_before_work(agent_server: Server) -> None:
    big = {"model": "default", "input": "x" * (5 << 20)}
    with agent_server.client(headers={"Authorization": f"Bearer {AGENT_KEYS[0]}"}) as c:
        r = c.post("/v1/responses", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with httpx.Client(base_url=agent_server.url) as c:  # no key: refused before parsing
        assert c.post("/v1/responses", json={"model": "default"}).status_code == 401
