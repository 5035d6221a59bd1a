"""The DSL's tool, logit_bias and thinking budget arguments without a model: checked values, the constraint
each ``tool_choice`` maps to, and the markers found in Qwen3's template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from frontend_dsl import gen, tool
from frontend_dsl.chat_template import render_chat_template
from frontend_dsl.ir import Gen
from frontend_dsl.tools import tool_markers, tools_json

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
CALC = tool("calc", "arithmetic", {"type": "object", "properties": {"e": {"type": "string"}}})
STRICT = tool("look", "facts", {"type": "object", "properties": {}}, strict=True)


def test_gen_logit_bias_is_checked_and_normalized() -> None:
    g = gen("x", logit_bias={"5": -100, 7: 2})
    assert isinstance(g, Gen) and g.params().logit_bias == {5: -100.0, 7: 2.0}
    for bad in ({"x": 1}, {5: 101}, {i: 1 for i in range(301)}):
        with pytest.raises(ValueError, match="logit_bias"):
            gen("x", logit_bias=bad)


def test_gen_thinking_budget_reaches_the_params() -> None:
    g = gen("x", thinking_token_budget=64)
    assert isinstance(g, Gen) and g.params().thinking_token_budget == 64
    with pytest.raises(ValueError, match="thinking_token_budget"):
        gen("x", thinking_token_budget=-1)


def test_tool_choice_maps_to_the_http_constraints() -> None:
    from radixserve.agents.registry import HERMES

    def constraint(**kw: object) -> dict[str, str]:
        g = gen("s", tools=[CALC, STRICT], **kw)  # type: ignore[arg-type]
        assert isinstance(g, Gen) and g.kind == "tools" and g.tools is not None
        return g.tools.constraint(HERMES)

    assert set(constraint()) == {"structural_tag"}  # a strict tool: enforced under auto
    assert "at_least_one" in constraint(tool_choice="required")["structural_tag"]
    assert set(constraint(tool_choice="calc")) == {"tagged_json"}
    plain = gen("s", tools=[CALC])
    assert isinstance(plain, Gen) and plain.tools is not None
    assert plain.tools.constraint(HERMES) == {}  # auto, nothing strict, parallel on: free
    from radixserve.agents.registry import QWEN3_CODER

    named = gen("s", tools=[CALC, STRICT], tool_choice="calc")  # XML: a structural tag forces it
    assert isinstance(named, Gen) and named.tools is not None
    forced = named.tools.constraint(QWEN3_CODER)["structural_tag"]
    assert "<function=calc>" in forced and "<function=look>" not in forced
    xml = "<tool_call>\n<function=calc>\n<parameter=e>\n1 + 2\n</parameter>\n</function>\n</tool_call>"
    assert named.tools.read(QWEN3_CODER, xml).arguments(0) == {"e": "1 + 2"}
    from radixserve.agents.registry import HARMONY, MISTRAL_V11, PYTHONIC

    # Formats that name the function in their markup: the markup is forced, not a JSON
    # call object (which would put a "name" member where the model never writes one).
    for fmt, begin in (
        (MISTRAL_V11, "[TOOL_CALLS]calc[ARGS]"),
        (HARMONY, "<|channel|>commentary to=functions.calc <|constrain|>json<|message|>"),
    ):
        (only,) = json.loads(named.tools.constraint(fmt)["structural_tag"])["format"]["tags"]
        assert (
            only["begin"] == begin
            and only["content"]["json_schema"] == CALC["function"]["parameters"]
        )
    grammar = json.loads(named.tools.constraint(PYTHONIC)["structural_tag"])["format"]["grammar"]
    assert 'call ::= ("calc("' in grammar and '"look("' not in grammar
    with pytest.raises(ValueError, match="tool_choice"):
        gen("s", tools=[CALC], tool_choice="nope")
    with pytest.raises(ValueError, match="tool"):
        gen("s", tools=[{"type": "function"}])


def test_markers_are_the_templates_own_rendering() -> None:
    template = (TEMPLATES / "qwen3.jinja").read_text()
    listed = tools_json([CALC, STRICT])
    m = tool_markers(template, listed)
    system = render_chat_template(
        template, [{"role": "system", "content": "S"}], tools=json.loads(listed)
    )
    assert system == m.system_prefix + "S" + m.system_suffix
    assert m.result_prefix.endswith("<tool_response>\n")
    assert m.result_suffix.startswith("\n</tool_response>")
    with pytest.raises(ValueError, match="does not render tools"):
        tool_markers("{{ messages[0].content }}", listed)
