"""Each tool-call and reasoning parser on outputs in its model's real format.

The outputs are the examples the model makers publish for their formats (sources beside
each), fed whole and split into every pair of chunks, plus malformed variants: a parse
never raises, malformed calls come back as content, and streamed deltas add up to the
non-streamed result.
"""

from __future__ import annotations

import json

import pytest
from stream_helpers import run, splits, whole

from radixserve.agents import hermes, llama3, mistral, pythonic, qwen_xml
from radixserve.agents import reasoning as think
from radixserve.agents.registry import (
    MISTRAL_V11,
    QWEN3_CODER,
    guess_tool_format,
    served_tool_format,
    tool_format,
)
from radixserve.agents.stream import OutputParser, ToolScan

# Qwen2.5 function-calling guide (qwen.readthedocs.io, "Function Calling", Hermes-style
# template), two parallel calls as Qwen2.5-7B-Instruct answered there.
QWEN_PARALLEL = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
    '"San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", '
    '"arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>'
)
# Qwen3 model card (thinking mode), reasoning then a call, in the format Qwen3 writes.
QWEN3_THINK_CALL = (
    "<think>\nThe user asks for the weather in Paris; I should call get_weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
# Llama 3.1 model card (JSON-based tool calling, "Model response" example).
LLAMA_CALL = (
    '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
    '"unit": "Fahrenheit"}}'
)
# mistral-common / Mistral-7B-Instruct-v0.3 function-calling example.
MISTRAL_CALL = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
    '"format": "celsius"}}]'
)
# Mistral's v11 calls (Mistral Small 3.2's template renders them so): the name in the markup,
# one marker per call; the second without [ARGS], as a detokenizer that drops it leaves it.
MISTRAL_V11_CALLS = (
    'Looking.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", '
    '"format": "celsius"}[TOOL_CALLS]get_time{"zone": "CET"}'
)
# Granite 3.x: the same array after its own marker (vLLM's granite parser's example).
GRANITE_CALL = (
    'Checking.<|tool_call|>[{"name": "get_current_weather", "arguments": {"city": "Dallas", '
    '"unit": "fahrenheit"}}, {"name": "get_time", "arguments": {"zone": "CST"}}]'
)
# Qwen3-Coder's XML format (its chat template's "ONLY reply in the following format"), two
# calls whose parameters' schemas make them a string, an integer, a boolean and an array.
QWEN_CODER_CALLS = (
    "I'll look both up.\n<tool_call>\n<function=get_current_temperature>\n"
    "<parameter=location>\nSan Francisco, CA, USA\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=search_files>\n<parameter=pattern>\n*.py\n</parameter>\n"
    "<parameter=max_results>\n20\n</parameter>\n<parameter=recursive>\ntrue\n</parameter>\n"
    '<parameter=paths>\n["src", "tests"]\n</parameter>\n</function>\n</tool_call>'
)
CODER_FUNCTIONS = [
    {
        "name": "get_current_temperature",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
    {
        "name": "search_files",
        "parameters": {
            "type": "object",
            "properties": {
                "pattern": {"type": "string"},
                "max_results": {"type": "integer"},
                "recursive": {"type": "boolean"},
                "paths": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
]
CODER_SCAN = QWEN3_CODER.scanner(CODER_FUNCTIONS)
# GLM-4.5: <tool_call>name, then <arg_key>/<arg_value> pairs, values read by the schemas.
GLM_SCAN = tool_format("glm45").scanner(CODER_FUNCTIONS)
GLM_CALL = (
    "Let me look.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York"
    "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
)
# Llama 3.2 / Llama 4 (vLLM's pythonic parser's examples): a list of calls, literals as values.
PYTHONIC_CALLS = (
    "[get_weather(city='San Francisco', metric='celsius'), "
    'search(query="a, (b) [c]", limit=3, exact=False, tags=["x", "y"], opts={"k": None})]'
)
LLAMA4_CALL = "<|python_start|>[get_time(zone='UTC')]<|python_end|>"
# DeepSeek-R1: the template opens <think> in the prompt; the answer starts inside it.
R1_ANSWER = "Okay, 2 + 2 is basic arithmetic.\n</think>\n\nThe answer is 4."


@pytest.mark.parametrize(
    "scan,text,calls,content",
    [
        (
            hermes.scan,
            QWEN_PARALLEL,
            [
                ("get_current_temperature", '{"location": "San Francisco, CA, USA"}'),
                (
                    "get_temperature_date",
                    '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}',
                ),
            ],
            "\n",
        ),
        (
            llama3.scan,
            LLAMA_CALL,
            [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')],
            "",
        ),
        (
            mistral.scan,
            MISTRAL_CALL,
            [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')],
            "",
        ),
        (
            mistral.scan,
            MISTRAL_V11_CALLS,
            [
                ("get_current_weather", '{"location": "Paris, France", "format": "celsius"}'),
                ("get_time", '{"zone": "CET"}'),
            ],
            "Looking.",
        ),
        (mistral.scan, "[TOOL_CALLS]ping[ARGS]{}", [("ping", "{}")], ""),
        (
            GLM_SCAN,
            GLM_CALL,
            [("get_weather", '{"city": "New York", "days": 3}')],
            "Let me look.",
        ),
        (GLM_SCAN, "<tool_call>get_time</tool_call>", [("get_time", "{}")], ""),
        (
            mistral.granite_scan,
            GRANITE_CALL,
            [
                ("get_current_weather", '{"city": "Dallas", "unit": "fahrenheit"}'),
                ("get_time", '{"zone": "CST"}'),
            ],
            "Checking.",
        ),
        (
            pythonic.scan,
            PYTHONIC_CALLS,
            [
                ("get_weather", '{"city": "San Francisco", "metric": "celsius"}'),
                (
                    "search",
                    '{"query": "a, (b) [c]", "limit": 3, "exact": false, "tags": ["x", "y"], '
                    '"opts": {"k": null}}',
                ),
            ],
            "",
        ),
        (pythonic.scan, LLAMA4_CALL, [("get_time", '{"zone": "UTC"}')], ""),
        (
            CODER_SCAN,
            QWEN_CODER_CALLS,
            [
                ("get_current_temperature", '{"location": "San Francisco, CA, USA"}'),
                (
                    "search_files",
                    '{"pattern": "*.py", "max_results": 20, "recursive": true, '
                    '"paths": ["src", "tests"]}',
                ),
            ],
            "I'll look both up.\n\n",
        ),
    ],
)
def test_calls_whole_and_split_anywhere(
    scan: ToolScan, text: str, calls: list[tuple[str, str]], content: str
) -> None:
    for pieces in splits(text):
        got = run(scan, None, pieces)
        assert got == whole(scan, None, text)
        assert got["calls"] == calls, pieces
        assert got["content"] == content, pieces
        for _, args in got["calls"]:
            json.loads(args)


def test_content_before_a_call_and_no_markup_leaks() -> None:
    text = "Let me check.\n" + QWEN_PARALLEL
    for pieces in splits(text):
        got = run(hermes.scan, None, pieces)
        assert got["content"] == "Let me check.\n\n"
        assert "<tool" not in got["content"] and len(got["calls"]) == 2


@pytest.mark.parametrize(
    "scan,text",
    [
        (hermes.scan, "<tool_call>\nnot json at all\n</tool_call>"),
        (hermes.scan, '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
        (hermes.scan, '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),
        (hermes.scan, '<tool_call>\n{"name": "f", "argu'),  # cut off
        (llama3.scan, '{"name": "f", "parameters": {"a": 1}'),  # unclosed
        (llama3.scan, '{"not": "a call"}'),
        (mistral.scan, "[TOOL_CALLS] [oops]"),
        (mistral.scan, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": '),
        (mistral.scan, "[TOOL_CALLS]not a name[ARGS]{}"),
        (mistral.scan, "[TOOL_CALLS]f[ARGS][1, 2]"),  # arguments not an object
        (mistral.scan, '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b": '),  # cut off
        (mistral.scan, "[TOOL_CALLS]f[ARGS]"),  # no arguments
        (pythonic.scan, "[1, 2, 3]"),
        (pythonic.scan, "[f(1)]"),  # positional arguments
        (pythonic.scan, "[f(a=g())]"),  # not a literal: never evaluated
        (pythonic.scan, "[f(a={1, 2})]"),  # a set: no JSON
        (pythonic.scan, "[f(a=1), g(b="),  # cut off
        (pythonic.scan, "[]"),
        (CODER_SCAN, "<tool_call>\nnot a function\n</tool_call>"),
        (CODER_SCAN, "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>"),
        (CODER_SCAN, "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>"),
        (CODER_SCAN, "<tool_call>\n<function=f>\n<parameter=a>\n1"),  # cut off
        (CODER_SCAN, "<tool_call>\n<function=f>\n</function>\nmore\n</tool_call>"),
        (GLM_SCAN, "<tool_call>\n<arg_key>a</arg_key></tool_call>"),  # no name
        (GLM_SCAN, "<tool_call>f\n<arg_key>a</arg_key>\nnot a value</tool_call>"),
    ],
)
def test_malformed_calls_are_content(scan: ToolScan, text: str) -> None:
    assert whole(scan, None, text) == {"content": text, "reasoning": "", "calls": []}
    for pieces in splits(text):
        got = run(scan, None, pieces)  # never raises; a call announced stays a call
        assert got["content"] == ("" if got["calls"] else text)


def test_plain_answers_stay_content() -> None:
    scans = (
        hermes.scan,
        llama3.scan,
        mistral.scan,
        mistral.granite_scan,
        CODER_SCAN,
        GLM_SCAN,
        pythonic.scan,
    )
    for scan in scans:
        for pieces in splits("The weather is < 20 C [ok]"):
            assert run(scan, None, pieces) == {
                "content": "The weather is < 20 C [ok]",
                "reasoning": "",
                "calls": [],
            }


def test_arguments_stream_before_the_call_ends() -> None:
    p = OutputParser(hermes.scan, None)
    first = p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == [
        (0, "get_weather", '{"city": "Pa')
    ]
    assert first.tool_calls[0].id and first.content == ""
    second = p.feed('ris"}}\n</tool_call>')
    assert [(c.id, c.name, c.arguments) for c in second.tool_calls] == [(None, None, 'ris"}')]


def test_xml_parameters_read_by_their_schemas() -> None:
    """A value is text where its schema says string (one newline either side is markup, the
    rest kept: code keeps its indentation); JSON where it says otherwise, or says nothing;
    text again where it is not JSON. Arguments stream a parameter at a time."""
    schemas = {
        "edit": {
            "path": {"type": "string"},
            "code": {"type": "string"},
            "line": {"type": ["integer", "null"]},
            "ratio": {"type": "number"},
            "flag": {"type": "boolean"},
            "mode": {"enum": ["a", "b"]},
        }
    }
    text = (
        "<tool_call>\n<function=edit>\n<parameter=path>\n42\n</parameter>\n"
        "<parameter=code>\n    return x\n\n</parameter>\n<parameter=line>\nnull\n</parameter>\n"
        "<parameter=ratio>\n0.5\n</parameter>\n<parameter=flag>\nmaybe\n</parameter>\n"
        '<parameter=mode>\nb\n</parameter>\n<parameter=extra>\n{"k": [1]}\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    (call,) = qwen_xml.scan(text, True, schemas).calls
    assert call.complete and call.name == "edit"
    assert json.loads(call.arguments) == {
        "path": "42",
        "code": "    return x\n",
        "line": None,
        "ratio": 0.5,
        "flag": "maybe",
        "mode": "b",
        "extra": {"k": [1]},
    }
    p = OutputParser(lambda t, f: qwen_xml.scan(t, f, schemas), None)
    first = p.feed(text[: text.index("<parameter=code>") + 20])
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("edit", '{"path": "42"')]


def test_reasoning_then_call_qwen3() -> None:
    for pieces in splits(QWEN3_THINK_CALL)[:40]:
        got = run(hermes.scan, think.QWEN3, pieces)
        assert got["reasoning"] == (
            "\nThe user asks for the weather in Paris; I should call get_weather.\n"
        )
        assert got["content"] == "" and got["calls"] == [("get_weather", '{"city": "Paris"}')]


def test_reasoning_deepseek_r1_starts_inside() -> None:
    for pieces in splits(R1_ANSWER):
        got = run(None, think.DEEPSEEK_R1, pieces)
        assert got["reasoning"] == "Okay, 2 + 2 is basic arithmetic.\n"
        assert got["content"] == "The answer is 4."
    # Never closed: all reasoning (R1); Qwen3 without <think>: all content.
    assert run(None, think.DEEPSEEK_R1, ["still thinking"])["reasoning"] == "still thinking"
    assert run(None, think.QWEN3, ["plain answer"])["content"] == "plain answer"


@pytest.mark.parametrize("fmt", [think.QWEN3, think.DEEPSEEK_R1], ids=lambda f: f.name)
def test_an_answer_after_a_prefill_starts_where_the_prefill_left_the_reasoning(
    fmt: think.ThinkFormat,
) -> None:
    """A reply the client began: its continuation is reasoning only if the prefill opened a
    think block and left it open, for either format (R1's template opens the block in the
    generation prompt, which a prefilled turn does not render)."""
    opened = think.after_prefill(fmt, "<think>\nThe user wants")
    closed = think.after_prefill(fmt, "<think>\nShort.\n</think>\n\nThe answer:")
    plain = think.after_prefill(fmt, "The answer:")
    reopened = think.after_prefill(fmt, "<think>a</think> b <think>c")
    assert opened.starts_inside and reopened.starts_inside
    assert not closed.starts_inside and not plain.starts_inside
    for pieces in splits(" a short reason</think>\n\n4."):
        assert run(None, opened, pieces) == {
            "content": "4.",
            "reasoning": "a short reason",
            "calls": [],
        }
    for pieces in splits(" 4, since 2 + 2 = 4."):
        got = run(None, closed, pieces)
        assert got == {"content": " 4, since 2 + 2 = 4.", "reasoning": "", "calls": []}


def test_template_guess_and_names() -> None:
    assert guess_tool_format("{{ tools }} <tool_call>") == tool_format("hermes")
    coder = "{{ tools }} <tool_call>\n<function=x>\n<parameter=y>"
    assert guess_tool_format(coder) == tool_format("qwen3_coder")
    assert guess_tool_format("{{ tools }} [TOOL_CALLS]") == tool_format("mistral")
    v11 = "{{ tools }} [TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}"
    assert guess_tool_format(v11) is MISTRAL_V11
    # --tool-call-parser mistral is either format, the one the template writes.
    assert served_tool_format("mistral", v11) is MISTRAL_V11
    assert served_tool_format("mistral", "{{ tools }} [TOOL_CALLS]") is tool_format("mistral")
    assert served_tool_format("hermes", v11) is tool_format("hermes")
    assert served_tool_format(None, v11) is MISTRAL_V11
    assert guess_tool_format("{{ tools }} <|tool_call|>") == tool_format("granite")
    glm = "{{ tools }} <tool_call>{{ name }}<arg_key>k</arg_key><arg_value>v</arg_value>"
    assert guess_tool_format(glm) == tool_format("glm45")
    assert guess_tool_format("{{ tools }} ipython") == tool_format("llama3_json")
    pythonic_example = "{{ tools }} [func_name1(params_name1=params_value1)] ipython"
    assert guess_tool_format(pythonic_example) == tool_format("pythonic")
    assert guess_tool_format("{{ messages }}") is None
    with pytest.raises(ValueError, match="known"):
        tool_format("nope")


@pytest.mark.parametrize(
    ("name", "answer"),
    [
        ("glm45", "<think>Two and two.</think>\n\nIt is 4."),
        ("qwen3-thinking", "Two and two.</think>\n\nIt is 4."),
        ("mistral", "[THINK]Two and two.[/THINK]\n\nIt is 4."),  # Magistral
        ("kimi", "\u25c1think\u25b7Two and two.\u25c1/think\u25b7\n\nIt is 4."),
    ],
)
def test_each_reasoning_format_reads_its_own_markup(name: str, answer: str) -> None:
    fmt = think.FORMATS[name]
    for pieces in splits(answer):
        got = run(None, fmt, pieces)
        assert (got["reasoning"], got["content"]) == ("Two and two.", "It is 4.")
    # Another format's markup is content to it.
    other = "<think>x</think>y" if fmt.start != "<think>" else "[THINK]x[/THINK]y"
    if not fmt.starts_inside:
        assert run(None, fmt, [other])["content"] == other
