"""The Responses and Messages APIs' pure parts, without a server: item conversion, the
response store's bounds and tenancy, and the streamed events of answers a random model
cannot write (reasoning, then a call) built from text deltas as the parsers read them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixserve.agents import harmony, reasoning
from radixserve.agents.registry import HARMONY, HERMES
from radixserve.serving.http.anthropic_errors import error_body
from radixserve.serving.http.chat_request import read_answer
from radixserve.serving.http.chat_tools import ToolPlan, output_parser
from radixserve.serving.http.errors import APIError
from radixserve.serving.http.messages import blocks as message_blocks
from radixserve.serving.http.messages_protocol import MessagesRequest
from radixserve.serving.http.messages_stream import Blocks
from radixserve.serving.http.responses_items import output_items, parse_items, to_messages
from radixserve.serving.http.responses_store import ResponseStore, tenant_of
from radixserve.serving.http.responses_stream import OutputItems, Writer

PLAN = ToolPlan("[]", HERMES.scan, None, reasoning.QWEN3)
ANSWER = (
    "<think>Need the weather.</think>Let me check."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
# The same answer as gpt-oss writes it (harmony: analysis, a preamble, then the call).
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
# Each format's plan and answer, for the tests that read one through both APIs' shapes.
FORMATS = pytest.mark.parametrize(
    ("plan", "answer"),
    [
        pytest.param(PLAN, ANSWER, id="qwen3"),
        pytest.param(
            ToolPlan("[]", HARMONY.scan, None, harmony.THINK, special_tokens=True),
            HARMONY_ANSWER,
            id="gpt-oss",
        ),
    ],
)


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def sse(raw: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for b in raw:
        head, data = b.decode().strip().split("\n")
        assert head == "event: " + json.loads(data[len("data: ") :])["type"]
        out.append(json.loads(data[len("data: ") :]))
    return out


@FORMATS
def test_items_render_one_assistant_turn_per_answer(plan: ToolPlan, answer: str) -> None:
    """reasoning + message + calls are one assistant turn; outputs name their function."""
    read = read_answer(plan, answer, "stop")
    assert [b["type"] for b in message_blocks(read)] == ["thinking", "text", "tool_use"]
    items = parse_items([{"role": "user", "content": "Paris?"}])
    items += output_items(read.content, read.reasoning, read.calls, incomplete=False)
    assert [i["type"] for i in items] == ["message", "reasoning", "message", "function_call"]
    call_id = items[-1]["call_id"]
    items += parse_items([{"type": "function_call_output", "call_id": call_id, "output": "18 C"}])
    msgs = to_messages(items, "Be brief.")
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool"]
    turn = msgs[2]
    assert turn.content == "Let me check." and turn.reasoning_content == "Need the weather."
    assert turn.tool_calls is not None and turn.tool_calls[0].name == "get_weather"
    assert json.loads(turn.tool_calls[0].arguments) == {"city": "Paris"}
    assert msgs[3].tool_call_id == call_id and msgs[3].name == "get_weather"


def test_reasoning_sealed_for_a_stateless_client_comes_back_as_reasoning() -> None:
    """``include: ["reasoning.encrypted_content"]``: each reasoning item, whole or streamed,
    carries its text sealed, and a reasoning item sent back with only that (store false, as
    Codex does) renders as the turn's reasoning; another provider's blob reads as none."""
    from radixserve.serving.http.responses_items import SEALED, sealed

    answer = read_answer(PLAN, ANSWER, "stop")
    whole = output_items(answer.content, answer.reasoning, answer.calls, False, seal=True)
    blob = whole[0]["encrypted_content"]
    assert blob.startswith(SEALED) and blob == sealed("Need the weather.")
    items = OutputItems(Writer(), seal=True)
    parser = output_parser(PLAN)
    assert parser is not None
    raw = items.apply(parser.feed(ANSWER)) + items.apply(parser.finish()) + items.finish(False)
    done = [e["item"] for e in sse(raw) if e["type"] == "response.output_item.done"]
    assert done[0]["type"] == "reasoning" and done[0]["encrypted_content"] == blob
    back = [{"type": "reasoning", "summary": [], "encrypted_content": blob}, *whole[1:]]
    for carried, reasoning_content in [(back, "Need the weather."), (whole, "Need the weather.")]:
        items_in = parse_items([{"role": "user", "content": "Paris?"}, *carried])
        assert to_messages(items_in, None)[1].reasoning_content == reasoning_content
    foreign = [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB..."}, *whole[1:]]
    assert (
        to_messages(parse_items([{"role": "user", "content": "Paris?"}, *foreign]), None)[
            1
        ].reasoning_content
        is None
    )


@FORMATS
def test_response_stream_events_for_reasoning_then_a_call(plan: ToolPlan, answer: str) -> None:
    parser = output_parser(plan)
    assert parser is not None
    items = OutputItems(Writer())
    raw: list[bytes] = []
    for piece in pieces(answer):
        raw += items.apply(parser.feed(piece))
    raw += items.apply(parser.finish()) + items.finish(incomplete=False)
    evs = sse(raw)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    added = [e["item"]["type"] for e in evs if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    text = "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta")
    content = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    args = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    assert (text, content, json.loads(args)) == (
        "Need the weather.",
        "Let me check.",
        {"city": "Paris"},
    )
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert done == items.done and done[0]["content"][0]["text"] == text
    assert done[2]["arguments"] == args and done[2]["status"] == "completed"


@FORMATS
def test_messages_stream_blocks_for_reasoning_then_a_call(plan: ToolPlan, answer: str) -> None:
    parser = output_parser(plan)
    assert parser is not None
    blocks = Blocks()
    raw: list[bytes] = []
    for piece in pieces(answer, 5):
        raw += blocks.apply(parser.feed(piece))
    raw += blocks.apply(parser.finish()) + blocks.close()
    evs = sse(raw)
    starts = [e["content_block"]["type"] for e in evs if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"] and blocks.calls == 1
    kinds = {e["delta"]["type"] for e in evs if e["type"] == "content_block_delta"}
    assert kinds == {"thinking_delta", "text_delta", "input_json_delta"}
    partial = "".join(
        e["delta"].get("partial_json", "") for e in evs if e["type"] == "content_block_delta"
    )
    assert json.loads(partial) == {"city": "Paris"}
    assert [e["index"] for e in evs if e["type"] == "content_block_stop"] == [0, 1, 2]


def test_messages_blocks_convert_to_chat_turns() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 4,
            "system": [{"type": "text", "text": "Sys"}],
            "messages": [
                {"role": "user", "content": "Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": ""},
                        {
                            "type": "tool_use",
                            "id": "t1",
                            "name": "get_weather",
                            "input": {"city": "P"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "18 C"}],
                        },
                        {"type": "text", "text": "And?"},
                    ],
                },
            ],
            "tool_choice": {"type": "any"},
            "thinking": {"type": "disabled"},
        }
    )
    msgs = body.chat()
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[2].reasoning_content == "hm" and msgs[2].tool_calls is not None
    assert msgs[3].content == "18 C" and msgs[3].name == "get_weather"
    assert body.chat_tool_choice() == "required"
    assert body.template_kwargs() == {"enable_thinking": False}


@pytest.mark.parametrize("budget", [-3, 0, 2.5, "1024", True])
def test_a_bad_thinking_budget_is_400(budget: Any) -> None:
    """A ``budget_tokens`` that no budget could be is the client's error (a 400 naming it),
    not silently taken."""
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": budget},
        }
    )
    with pytest.raises(APIError) as err:
        body.template_kwargs()
    assert err.value.status == 400 and "budget_tokens" in str(err.value)


def test_a_thinking_budget_is_taken() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 4096,
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 2048},
        }
    )
    assert body.template_kwargs() == {"enable_thinking": True}
    assert body.thinking_budget() == 2048  # the request's thinking_token_budget


def test_disabled_thinking_has_no_budget() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "disabled"},
        }
    )
    assert body.thinking_budget() is None


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "image", "source": {}}],
        [{"type": "tool_use", "id": "x", "name": "f"}],  # a user turn cannot call
        [{"type": "tool_result"}],  # no tool_use_id
    ],
)
def test_malformed_message_blocks_are_400(content: Any) -> None:
    body = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
    )
    with pytest.raises(APIError) as err:
        body.chat()
    assert err.value.status == 400


def test_store_bounds_ttl_and_tenants() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=3, max_chars=300, ttl_s=10.0, clock=lambda: now[0])
    a, b = tenant_of("key-a"), tenant_of("key-b")
    assert a != b and tenant_of(None) == ""
    item = [{"type": "message", "role": "user", "content": "x" * 20}]
    for i in range(4):
        assert store.put(a, f"r{i}", item, "s")
    assert len(store) == 3 and store.get(a, "r0") is None  # count bound: oldest out
    assert store.get(b, "r1") is None and store.get(a, "r1") is not None  # per tenant
    assert not store.put(a, "huge", [{"content": "y" * 500}], "s")  # alone over the size
    store.put(a, "r4", [{"content": "z" * 150}], "s")  # size bound evicts the least recent
    assert store.chars <= 300 and store.get(a, "r1") is not None and store.get(a, "r4") is not None
    now[0] = 100.0
    assert store.get(a, "r4") is None and len(store) == 0 and store.chars == 0  # TTL


def test_anthropic_error_shape() -> None:
    assert error_body(401, "no")["error"]["type"] == "authentication_error"
    assert error_body(502, "x") == {"type": "error", "error": {"type": "api_error", "message": "x"}}


def test_pythonic_calls_are_read_and_forced_by_their_grammar() -> None:
    """The pythonic format's calls are read back (auto); a required or named call is forced
    by the pythonic grammar (one call without parallel calls or with a named one); what
    would need calls constrained under auto (one call at most, strict tools) is a 400."""
    from radixserve.serving.http.chat_tools import FunctionIn, ToolIn, plan

    tools = [ToolIn(function=FunctionIn(name="get_time", parameters={"type": "object"}))]
    template = "{{ tools }} [func_name1(params_name1=params_value1)]"
    auto = plan(tools, "auto", template, None, None, False)
    assert auto.parse_with is not None and auto.forced is None and auto.structural_tag is None
    parser = output_parser(auto)
    assert parser is not None
    parser.parse("[get_time(zone='UTC')]")
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_time", '{"zone": "UTC"}')]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, parallel, several in [
        ("required", None, True),
        ("required", False, False),
        (named, None, False),
    ]:
        forced = plan(tools, choice, template, "pythonic", None, False, parallel)
        assert forced.forced is None and forced.structural_tag is not None
        grammar = json.loads(forced.structural_tag)["format"]["grammar"]
        assert grammar.startswith('root ::= "[" call' + (' (", " call)*' if several else ' "]"'))
    strict = [ToolIn(function=FunctionIn(name="f", parameters={}, strict=True))]
    for tools_, choice, parallel, says in [
        (tools, "auto", False, "parallel_tool_calls false"),
        (strict, "auto", None, "strict tools"),
    ]:
        with pytest.raises(APIError, match=says):
            plan(tools_, choice, template, "pythonic", None, False, parallel)


def test_granite_calls_are_forced_after_their_marker() -> None:
    """Granite 3.x's format (guessed from ``<|tool_call|>`` in the template): a required
    call is the marker and a one-call array valid against the schema; several, an array."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from radixserve.constrained.grammar import structural_tag_grammar, tagged_json_grammar
    from radixserve.serving.http.chat_tools import FunctionIn, ToolIn, plan

    schema = {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CST"]}},
        "required": ["zone"],
    }
    tools = [ToolIn(function=FunctionIn(name="get_time", parameters=schema))]
    template = "{{ tools }} <|tool_call|>"
    one = plan(tools, "required", template, None, None, False, False)
    assert one.forced is not None and one.parse_with is not None
    grammar: xgr.Grammar = tagged_json_grammar(one.forced)
    assert accepts(grammar, '<|tool_call|>[{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    assert not accepts(grammar, '<|tool_call|>[{"name": "get_time", "arguments": {"zone": "PST"}}]')
    several = plan(tools, "required", template, None, None, False, True)
    assert several.structural_tag is not None
    tag = structural_tag_grammar(several.structural_tag)
    call = '{"name": "get_time", "arguments": {"zone": "CST"}}'
    assert accepts(tag, f"<|tool_call|>[{call}, {call}]")
    parser = output_parser(one)
    assert parser is not None
    parser.parse(f"<|tool_call|>[{call}]")
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_time", '{"zone": "CST"}')]


def test_glm45_calls_are_forced_as_key_value_pairs() -> None:
    """GLM-4.5's format (guessed from ``<arg_key>`` in the template): a required call is
    ``<tool_call>name`` and its arguments' key/value pairs, valid against the schema (an
    integer stays an integer when read back); a named one only that function."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from radixserve.constrained.grammar import structural_tag_grammar
    from radixserve.serving.http.chat_tools import FunctionIn, ToolIn, plan

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    }
    tools = [
        ToolIn(function=FunctionIn(name="get_weather", parameters=schema)),
        ToolIn(function=FunctionIn(name="get_time", parameters={"type": "object"})),
    ]
    template = "{{ tools }} <tool_call>{{ name }}<arg_key>"
    forced = plan(
        tools,
        {"type": "function", "function": {"name": "get_weather"}},
        template,
        None,
        None,
        False,
    )
    assert forced.structural_tag is not None
    grammar = structural_tag_grammar(forced.structural_tag)
    call = (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    assert accepts(grammar, call)
    assert not accepts(grammar, call.replace(">3<", ">three<"))
    assert not accepts(grammar, call.replace("get_weather", "get_time"))
    parser = output_parser(forced)
    assert parser is not None
    parser.parse(call)
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]
