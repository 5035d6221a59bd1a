"""Structural-tag constraints for tool calls (:mod:`radixserve.agents.tool_tags`) in each
format: strict tools under ``auto`` (free text, but an opened call follows its schema),
several ``required`` calls with parallel calls on, exactly one with them off. What the
constraint lets through parses back as the calls with each format's own parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from radixserve.agents.registry import (
    HARMONY,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_V11,
    QWEN3_CODER,
    ToolFormat,
)
from radixserve.agents.stream import OutputParser
from radixserve.agents.tool_tags import auto_calls, required_calls
from radixserve.constrained import Constraint
from radixserve.constrained.grammar import GrammarCompiler
from radixserve.constrained.matcher import GrammarMatcher
from radixserve.sampling_params import SamplingParams

ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
FUNCS: list[dict[str, Any]] = [
    {"name": "get_time", "parameters": ZONE, "strict": True},
    {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
]


@pytest.fixture(scope="module")
def compiler(tiny_llama_dir: Path) -> GrammarCompiler:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    compiler = GrammarCompiler(tok, vocab_size=len(tok), stop_token_ids=[2])
    compiler.tok = tok  # type: ignore[attr-defined]
    return compiler


def feed(compiler: Any, spec: str, text: str) -> GrammarMatcher | None:
    """The matcher after ``text`` (``None``: the constraint refused a token of it)."""
    assert SamplingParams(structural_tag=spec).validate().constraint is not None
    m = compiler.new_matcher(Constraint("structural_tag", spec))
    ok = all(m.accept(t) for t in compiler.tok.encode(text, add_special_tokens=False))
    return m if ok else None


def calls(fmt: ToolFormat, *objs: dict[str, Any]) -> str:
    """Calls as the format writes them (and as the constraint forces them)."""

    def one(name: str, args: dict[str, Any]) -> str:
        return json.dumps({"name": name, fmt.args_key: args})

    def xml(name: str, args: dict[str, Any]) -> str:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
            for k, v in args.items()
        )
        return f"{fmt.begin}{name}>\n{params.removesuffix(chr(10))}{fmt.end}"

    if fmt.xml:
        return "\n".join(xml(o["name"], o["args"]) for o in objs)
    if fmt.array:
        return fmt.begin + "[" + ", ".join(one(o["name"], o["args"]) for o in objs) + "]" + fmt.end
    if fmt.head is not None:  # Mistral v11, harmony: the name in the markup
        return fmt.separator.join(
            fmt.begin + fmt.head.format(name=o["name"]) + json.dumps(o["args"]) + fmt.end
            for o in objs
        )
    return fmt.separator.join(fmt.begin + one(o["name"], o["args"]) + fmt.end for o in objs)


def fmt_id(fmt: ToolFormat) -> str:
    return "mistral_v11" if fmt is MISTRAL_V11 else fmt.name


def parsed(fmt: ToolFormat, text: str) -> list[tuple[str, dict[str, Any]]]:
    parser = OutputParser(fmt.scanner(FUNCS), None)
    parser.parse(text)
    return [(c.name, json.loads(c.arguments)) for c in parser.calls]


UTC = {"name": "get_time", "args": {"zone": "UTC"}}
BAD = {"name": "get_time", "args": {"zone": "Mars"}}
WEATHER = {"name": "get_weather", "args": {"any": [1, "thing"]}}


@pytest.mark.parametrize(
    "fmt", [HERMES, QWEN3_CODER, LLAMA3_JSON, MISTRAL, MISTRAL_V11, HARMONY], ids=fmt_id
)
def test_required_with_and_without_parallel_calls(compiler: Any, fmt: ToolFormat) -> None:
    several = required_calls(fmt, FUNCS, parallel=True)
    two = calls(fmt, UTC, {"name": "get_time", "args": {"zone": "CET"}})
    m = feed(compiler, several, two)
    assert m is not None and m.is_completed
    assert parsed(fmt, two) == [("get_time", {"zone": "UTC"}), ("get_time", {"zone": "CET"})]
    assert feed(compiler, several, calls(fmt, BAD)) is None  # required: every schema holds
    assert feed(compiler, several, "Sure, " + calls(fmt, UTC)) is None  # only calls
    one = required_calls(fmt, FUNCS, parallel=False)
    m = feed(compiler, one, calls(fmt, UTC))
    assert m is not None and m.can_only_end
    assert feed(compiler, one, two) is None


@pytest.mark.parametrize("fmt", [HERMES, QWEN3_CODER, MISTRAL, MISTRAL_V11, HARMONY], ids=fmt_id)
def test_strict_tools_under_auto(compiler: Any, fmt: ToolFormat) -> None:
    auto = auto_calls(fmt, FUNCS, parallel=True)
    text = "Let me check. " + calls(fmt, UTC)
    m = feed(compiler, auto, text)
    assert m is not None and m.is_completed
    assert parsed(fmt, text) == [("get_time", {"zone": "UTC"})]
    assert feed(compiler, auto, "No call at all, just text.") is not None
    assert feed(compiler, auto, "Checking. " + calls(fmt, BAD)) is None  # strict: refused
    assert feed(compiler, auto, calls(fmt, WEATHER)) is not None  # not strict: any object
    assert feed(compiler, auto, calls(fmt, {"name": "nope", "args": {}})) is None
    single = auto_calls(fmt, FUNCS, parallel=False)
    m = feed(compiler, single, "Ok. " + calls(fmt, UTC))
    assert m is not None and m.can_only_end  # no second call, no more text


def test_llama3_auto_trigger_is_the_call_object(compiler: Any) -> None:
    auto = auto_calls(LLAMA3_JSON, FUNCS, parallel=False)
    assert feed(compiler, auto, calls(LLAMA3_JSON, UTC)) is not None
    assert feed(compiler, auto, calls(LLAMA3_JSON, BAD)) is None


def test_bad_structural_tag_is_refused_before_compiling() -> None:
    for bad in ("not json", json.dumps({"type": "structural_tag"}), "[]"):
        with pytest.raises(ValueError, match="structural_tag"):
            SamplingParams(structural_tag=bad).validate()
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(structural_tag=required_calls(HERMES, FUNCS, True), regex="a").validate()
