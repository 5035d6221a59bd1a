"""Tool calling and reasoning through the real ``openai`` SDK against ``radixserve serve``.

Each chat template of tests/fixtures/chat_templates (Qwen3, Qwen3-Coder's XML, Llama 3.1
and Mistral formats) over the tiny random Llama: Qwen3's the agent server's own
(``--chat-template``, with its reasoning parser), the others sent with every request to
the shared server (vLLM's ``chat_template``), whose tool parser each guesses. A random model does not call
tools on its own, so calls are forced (``tool_choice: "required"`` / a named function):
the test sees the forced call come back as ``message.tool_calls`` (and as streamed
``delta.tool_calls``), with arguments valid against the schema, then sends the tool
result and gets the next turn. The prefix property is measured with ``cached_tokens``: turn N+1's prompt starts
with turn N's prompt, and how much of turn N's answer the cache also covers is reported
per template (the numbers are in docs/agents.md).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, NamedTuple

import openai
import pytest
from bench_modules import load
from http_helpers import AGENT_KEYS, TEMPLATES, Server

PAGE = 4  # ENGINE_FLAGS' page size

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS: list[Any] = [WEATHER, TIME]


class Target(NamedTuple):
    """Where a template's tests run: a server, the template each request sends (None: the
    server's own) and the API key."""

    srv: Server
    template: str | None
    key: str

    @property
    def url(self) -> str:
        return self.srv.url


@pytest.fixture(
    scope="module", params=["qwen3.jinja", "qwen3_coder.jinja", "llama3_1.jinja", "mistral.jinja"]
)
def tool_server(
    request: pytest.FixtureRequest, server: Server, agent_server: Server
) -> tuple[str, Target]:
    """Qwen3's template on the agent server (its own, by --chat-template, with the qwen3
    reasoning parser); each other one sent with every request (vLLM's chat_template) to the
    shared server, which takes them: no server of its own to start."""
    name = request.param
    if name == "qwen3.jinja":
        return name, Target(agent_server, None, AGENT_KEYS[0])
    return name, Target(server, (TEMPLATES / name).read_text(), "none")


def test_the_agent_server_renders_with_the_template_its_flag_named(agent_server: Server) -> None:
    headers = {"Authorization": f"Bearer {AGENT_KEYS[0]}"}
    with agent_server.client(headers=headers) as c:
        info = c.get("/tokenizer_info").json()
    assert info["chat_template"] == (TEMPLATES / "qwen3.jinja").read_text()


class _Completions:
    def __init__(self, client: openai.OpenAI, template: str | None) -> None:
        self._client, self._template = client, template

    def create(self, **kw: Any) -> Any:
        if self._template is not None:
            kw["extra_body"] = {**(kw.get("extra_body") or {}), "chat_template": self._template}
        return self._client.chat.completions.create(**kw)


class ToolClient:
    """The ``openai`` client of a target whose chat completions carry its template."""

    def __init__(self, target: Target) -> None:
        client = openai.OpenAI(base_url=target.url + "/v1", api_key=target.key, max_retries=0)
        self.chat = SimpleNamespace(completions=_Completions(client, target.template))


def sdk(target: Target | Server) -> Any:
    if isinstance(target, Server):
        return openai.OpenAI(base_url=target.url + "/v1", api_key="none", max_retries=0)
    return ToolClient(target)


def check_call(call: Any, name: str) -> dict[str, Any]:
    assert call.type == "function" and call.id and call.function.name == name
    args = json.loads(call.function.arguments)
    if name == "get_weather":
        # Qwen3-Coder's XML format lets whitespace surround a value, and a string keeps it
        # (qwen_xml): a random model writes some, within the length the schema allows.
        city = args["city"].strip() if isinstance(args.get("city"), str) else None
        assert set(args) == {"city"} and city is not None and len(city) <= 12
    else:
        assert args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")
    return args


def test_tool_loop_forced_calls_and_prefix_reuse(tool_server: tuple[str, Target]) -> None:
    """Turn 1 forces a call, turn 2 sends the result and forces another, turn 3 answers:
    each turn's prompt is cached from the previous one's prompt on."""
    name, srv = tool_server
    client = sdk(srv)
    messages: list[Any] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    prompts: list[int] = []
    answers: list[int] = []
    cached: list[int] = []
    for turn, choice in enumerate(
        ["required", {"type": "function", "function": {"name": "get_time"}}, "none"]
    ):
        r = client.chat.completions.create(
            model="default",
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,  # one call a turn (the default allows several)
            max_tokens=200,
            temperature=0,
        )
        c = r.choices[0]
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        prompts.append(r.usage.prompt_tokens)
        answers.append(r.usage.completion_tokens)
        cached.append(r.usage.prompt_tokens_details.cached_tokens or 0)
        if turn < 2:
            assert c.finish_reason == "tool_calls", c
            assert c.message.tool_calls and len(c.message.tool_calls) == 1
            call = c.message.tool_calls[0]
            want = "get_time" if turn == 1 else call.function.name
            check_call(call, want)
            assert not c.message.content  # no markup leaks into the content
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [call.model_dump()],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"})
        else:
            assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    # Turn N+1's prompt starts with turn N's whole prompt (the cache holds it, whole pages).
    for n in (1, 2):
        assert cached[n] >= (prompts[n - 1] // PAGE) * PAGE - PAGE, (name, prompts, cached)
    # And how much of turn N's answer was reused too (the template re-renders the call).
    reused = [cached[n] - prompts[n - 1] for n in (1, 2)]
    print(f"\n{name}: prompts {prompts} answers {answers} cached {cached} answer-reuse {reused}")


def test_streamed_required_call_in_openai_shape(tool_server: tuple[str, Target]) -> None:
    _, srv = tool_server
    stream = sdk(srv).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Time in Berlin?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    ids, names, args, content, finish = [], [], "", "", None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.append(tc.id)
                    names.append(tc.function.name)
                args += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert len(ids) == 1 and names == ["get_time"], (ids, names)
    assert json.loads(args)["zone"] in ("UTC", "CET")
    assert content == "" and finish == "tool_calls"


def test_required_parallel_calls_with_n_seed_and_stop(tool_server: tuple[str, Target]) -> None:
    """``required`` with parallel calls off: exactly one valid call per choice; on (OpenAI's
    default): one or more, each valid (a random model picks how many). ``n``, ``seed`` and
    ``stop`` keep working: seeded choices repeat across requests."""
    name, srv = tool_server
    client = sdk(srv)
    kw: dict[str, Any] = dict(
        model="default",
        messages=[{"role": "user", "content": "Weather and time?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=300,
        temperature=1.0,
        seed=11,
        n=3,
        stop=["zzz"],
    )
    one = client.chat.completions.create(**kw, parallel_tool_calls=False)
    again = client.chat.completions.create(**kw, parallel_tool_calls=False)
    for c in one.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls or []) == 1, c
        check_call(c.message.tool_calls[0], c.message.tool_calls[0].function.name)  # type: ignore[index]
    assert [c.message.tool_calls[0].function.arguments for c in one.choices] == [  # type: ignore[index]
        c.message.tool_calls[0].function.arguments
        for c in again.choices  # type: ignore[index]
    ]
    several = client.chat.completions.create(**kw)
    counts = []
    for c in several.choices:
        assert c.message.tool_calls, c
        for call in c.message.tool_calls:
            check_call(call, call.function.name)
        counts.append(len(c.message.tool_calls))
    print(f"\n{name}: calls per choice with parallel_tool_calls on: {counts}")


@pytest.mark.parametrize(
    "template", ["llama3_2_pythonic.jinja", "glm45.jinja", "mistral_v11.jinja", "gpt_oss.jinja"]
)
def test_calls_forced_with_a_template_of_their_own_format(server: Server, template: str) -> None:
    """Llama 3.2's pythonic calls, GLM-4.5's key/value calls and Mistral's v11 named calls
    (the template sent with every
    request, the format guessed from it), forced by each format's grammar: a required call
    and a named one come back as ``tool_calls`` valid against the schemas, the next turn
    renders the call back and reuses the cached prompt, and parallel required calls are
    each valid."""
    client = sdk(Target(server, (TEMPLATES / template).read_text(), "none"))
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw: dict[str, Any] = dict(model="default", tools=TOOLS, max_tokens=200, temperature=0)
    first = client.chat.completions.create(
        messages=messages, tool_choice="required", parallel_tool_calls=False, **kw
    )
    c = first.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls or []) == 1, c
    call = c.message.tool_calls[0]  # type: ignore[index]
    check_call(call, call.function.name)
    assert not c.message.content
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    named = {"type": "function", "function": {"name": "get_time"}}
    second = client.chat.completions.create(messages=messages, tool_choice=named, **kw)
    check_call(second.choices[0].message.tool_calls[0], "get_time")  # type: ignore[index]
    details = second.usage.prompt_tokens_details  # type: ignore[union-attr]
    assert details.cached_tokens >= (first.usage.prompt_tokens // PAGE - 1) * PAGE  # type: ignore[union-attr]
    # A random model sampled at temperature 1 may chain many calls: room for them to end.
    sampled = {**kw, "temperature": 1.0, "max_tokens": 600}
    several = client.chat.completions.create(
        messages=messages[:1], tool_choice="required", n=2, seed=3, **sampled
    )
    for choice in several.choices:
        assert choice.message.tool_calls, choice
        for each in choice.message.tool_calls:
            check_call(each, each.function.name)


def test_strict_tool_under_auto_is_served(tool_server: tuple[str, Target]) -> None:
    """A ``strict`` tool under ``auto`` constrains an opened call (tests/constrained/
    test_tool_tags.py checks the grammar); here: it is accepted and a random model's
    answer, which opens no call, stays content."""
    _, srv = tool_server
    strict = {"type": "function", "function": {**TIME["function"], "strict": True}}
    r = sdk(srv).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hello"}],
        tools=[WEATHER, strict],
        parallel_tool_calls=False,
        max_tokens=8,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    for call in c.message.tool_calls or []:
        check_call(call, call.function.name)


def test_auto_answers_without_calls_stay_content(tool_server: tuple[str, Target]) -> None:
    name, srv = tool_server
    r = sdk(srv).chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Hello"}],
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
        n=2,
        seed=3,
        stop=["zzz"],
    )
    for c in r.choices:  # a random model writes no call: its text is the content
        assert c.message.tool_calls is None and isinstance(c.message.content, str)
        assert c.finish_reason in ("stop", "length")


def test_bad_tool_requests_are_400(tool_server: tuple[str, Target]) -> None:
    _, srv = tool_server
    client = sdk(srv)
    base: dict[str, Any] = {"model": "default", "messages": [{"role": "user", "content": "x"}]}
    cases: list[dict[str, Any]] = [
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": TOOLS, "tool_choice": "sometimes"},
        {"tool_choice": "required"},
        {"tools": [WEATHER] * 2},
        {"tools": [WEATHER] * 129},
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {"extra_body": {"chat_template_kwargs": {"tools": []}}, "tools": TOOLS},
        {"extra_body": {"chat_template_kwargs": {"k": "v" * 5000}}},
    ]
    for extra in cases:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**base, **extra, max_tokens=2)


def test_reasoning_split_with_thinking_template(tool_server: tuple[str, Target]) -> None:
    """Qwen3 server (--reasoning-parser qwen3): with enable_thinking false the template
    closes the think block in the prompt, the answer is all content and
    reasoning_content is null; the kwargs reach the template (the prompt grows)."""
    name, srv = tool_server
    if name != "qwen3.jinja":
        pytest.skip("the reasoning parser runs on the Qwen3 server")
    client = sdk(srv)
    msgs = [{"role": "user", "content": "Hi"}]
    on = client.chat.completions.create(model="default", messages=msgs, max_tokens=4, temperature=0)
    off = client.chat.completions.create(
        model="default",
        messages=msgs,
        max_tokens=4,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert on.usage and off.usage and off.usage.prompt_tokens > on.usage.prompt_tokens
    assert isinstance(off.choices[0].message.content, str)
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


# Harmony text a random model writes when a regex holds it to the format: an analysis
# message, then the final answer (the markup is plain text to the tiny Llama's tokenizer).
HARMONY_ANSWER = (
    r"<\|channel\|>analysis<\|message\|>[a-z]{1,8}<\|end\|>"
    r"<\|start\|>assistant<\|channel\|>final<\|message\|>[a-z]{1,8}<\|return\|>"
)


def test_harmony_reasoning_split(server: Server) -> None:
    """gpt-oss's template sent with the request, on the shared server (no reasoning parser):
    its harmony format implies harmony's reasoning split, so the analysis message comes back
    as reasoning_content, the final one as content, with no markup, streamed and not; a
    forced call streams as delta.tool_calls."""
    client = sdk(Target(server, (TEMPLATES / "gpt_oss.jinja").read_text(), "none"))
    kw: dict[str, Any] = dict(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=300,
        temperature=0,
        extra_body={"regex": HARMONY_ANSWER},
    )
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    reasoning = getattr(m, "reasoning_content", None)
    assert reasoning and reasoning.isalpha() and m.content and m.content.isalpha(), m
    assert r.choices[0].finish_reason == "stop" and not m.tool_calls
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for key in parts:
            parts[key] += getattr(chunk.choices[0].delta, key, None) or "" if chunk.choices else ""
    assert parts == {"reasoning_content": reasoning, "content": m.content}
    # A forced call streamed: announced with its name, its arguments in fragments, no markup.
    named = {"type": "function", "function": {"name": "get_time"}}
    calls: dict[int, list[str]] = {}
    text, reasons = "", []
    for chunk in client.chat.completions.create(
        model="default", messages=kw["messages"], tools=TOOLS, tool_choice=named, stream=True
    ):
        for choice in chunk.choices:
            text += (choice.delta.content or "") + (
                getattr(choice.delta, "reasoning_content", None) or ""
            )
            reasons.append(choice.finish_reason)
            for tc in choice.delta.tool_calls or []:
                calls.setdefault(tc.index, ["", ""])
                calls[tc.index][0] += tc.function.name or ""
                calls[tc.index][1] += tc.function.arguments or ""
    assert text == "" and reasons[-1] == "tool_calls"
    assert list(calls) == [0] and calls[0][0] == "get_time"
    assert json.loads(calls[0][1])["zone"] in ("UTC", "CET")


def test_default_template_without_tools_is_an_informative_400(server: Server) -> None:
    """The plain ChatML template (SmolLM2's shape) renders no tools: a 400 that says so;
    tool_choice "none" drops them and answers."""
    client = sdk(server)
    msgs: Any = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        client.chat.completions.create(model="default", messages=msgs, tools=TOOLS, max_tokens=2)
    r = client.chat.completions.create(
        model="default", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert r.choices[0].message.tool_calls is None


def test_agent_loop_benchmark_script(tool_server: tuple[str, Target]) -> None:
    """benchmarks/bench_agent_loop.py runs against the Qwen3 server (2 agents, 2 tool turns):
    every turn after the first has the previous turn's prompt cached."""
    name, srv = tool_server
    if name != "qwen3.jinja":
        pytest.skip("one template is enough for the script")
    bench = load("bench_agent_loop.py", "bench_agent_loop")
    records = bench.run(srv.url, agents=2, turns=2, api_key=srv.key)
    assert [(r["agent"], r["turn"]) for r in records] == [(a, t) for a in (0, 1) for t in (1, 2, 3)]
    for prev, r in zip(records, records[1:], strict=False):
        if r["turn"] > 1:
            assert r["call"] is not None or r["turn"] == 3
            assert r["cached_tokens"] >= prev["prompt_tokens"] - 2 * PAGE
    assert records[3]["cached_tokens"] > 0  # agent 1 starts from the shared system prompt
