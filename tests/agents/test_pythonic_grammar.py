"""The grammar of forced pythonic calls (agents/pythonic_grammar.py), compiled by xgrammar
as a request's constraint is: any arguments valid against the schema, written as Python
literals, are accepted and read back by the pythonic parser as the same JSON (a property
test over generated arguments); a missing required argument, a wrong type, a string past
its length, an unknown name or more calls than allowed are refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xgrammar.testing import _is_grammar_accept_string as accepts

from radixserve.agents import pythonic
from radixserve.agents.pythonic_grammar import structural_tag
from radixserve.constrained.grammar import structural_tag_grammar

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "detail": {
                "type": "object",
                "properties": {
                    "hourly": {"type": "boolean"},
                    "scale": {"type": ["number", "null"]},
                },
                "required": ["hourly"],
            },
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["city"],
    },
}
ANY = {"name": "anything", "parameters": {"type": "object"}}
GRAMMARS: dict[bool, Any] = {}


def _grammar(several: bool) -> Any:
    if several not in GRAMMARS:
        GRAMMARS[several] = structural_tag_grammar(structural_tag([WEATHER, ANY], several))
    return GRAMMARS[several]


def _py(value: Any) -> str:
    """A JSON value as the Python literal a model writes (double-quoted strings)."""
    if isinstance(value, bool) or value is None:
        return {True: "True", False: "False", None: "None"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_py(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def _call(name: str, args: dict[str, Any]) -> str:
    return f"{name}(" + ", ".join(f"{k}={_py(v)}" for k, v in args.items()) + ")"


texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r"), max_size=12)
weather_args = st.fixed_dictionaries(
    {"city": texts},
    optional={
        "days": st.integers(-(10**6), 10**6),
        "unit": st.sampled_from(["celsius", "fahrenheit"]),
        "detail": st.fixed_dictionaries(
            {"hourly": st.booleans()},
            optional={"scale": st.none() | st.floats(-1e6, 1e6, allow_nan=False)},
        ),
        "tags": st.lists(texts, max_size=3),
    },
)


def _ordered(args: dict[str, Any], schema: Any = WEATHER["parameters"]) -> dict[str, Any]:
    """Keyword arguments (and a dict's items) in the schema's order, as the grammar has them."""
    props = schema["properties"]
    order = list(props)
    return {
        k: _ordered(args[k], props[k]) if isinstance(args[k], dict) else args[k]
        for k in sorted(args, key=order.index)
    }


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(weather_args, min_size=1, max_size=3))
def test_valid_arguments_are_accepted_and_read_back_as_the_same_json(calls: list[Any]) -> None:
    ordered = [_ordered(a) for a in calls]
    text = "[" + ", ".join(_call("get_weather", a) for a in ordered) + "]"
    assert accepts(_grammar(True), text), text
    assert accepts(_grammar(False), text) == (len(calls) == 1)
    scanned = pythonic.scan(text, final=True)
    assert scanned.content == ""
    assert [json.loads(c.arguments) for c in scanned.calls] == ordered


@pytest.mark.parametrize(
    "text",
    [
        "[get_weather(days=3)]",  # city is required
        "[get_weather(city=3)]",
        '[get_weather(city="a place far too long")]',
        '[get_weather(city="Paris", unit="kelvin")]',
        '[get_weather(city="Paris", detail={"scale": 1})]',  # hourly is required
        '[get_weather(city="Paris", days=1.5)]',
        '[get_weather(city="Paris", tags=[1])]',
        '[get_weather(unit="celsius", city="Paris")]',  # the schema's order
        '[get_time(zone="UTC")]',  # not a tool
        'get_weather(city="Paris")',
        "[]",
    ],
)
def test_what_the_schema_does_not_allow_is_refused(text: str) -> None:
    assert not accepts(_grammar(True), text)


def test_a_tool_without_properties_takes_any_keyword_arguments() -> None:
    text = '[anything(), anything(a=1, b_2=[True, None], c={"k": "v"}, d=-2.5e-3)]'
    assert accepts(_grammar(True), text)
    calls = pythonic.scan(text, final=True).calls
    assert [json.loads(c.arguments) for c in calls] == [
        {},
        {"a": 1, "b_2": [True, None], "c": {"k": "v"}, "d": -0.0025},
    ]


def test_a_schema_nested_past_the_depth_bound_costs_no_recursion() -> None:
    """A hostile schema thousands of arrays deep: spelled exactly to MAX_DEPTH, any literal
    below, so the grammar stays small and compiles."""
    from radixserve.agents.pythonic_grammar import MAX_DEPTH, calls_grammar

    deepest: dict[str, Any] = {"type": "integer"}
    for _ in range(5000):
        deepest = {"type": "array", "items": deepest}
    fn = {"name": "f", "parameters": {"type": "object", "properties": {"x": deepest}}}
    grammar = calls_grammar([fn], several=False)
    assert grammar.count("::=") < 3 * MAX_DEPTH + 20
    compiled = structural_tag_grammar(structural_tag([fn], False))
    assert accepts(compiled, "[f(x=" + "[" * 40 + "1" + "]" * 40 + ")]")
