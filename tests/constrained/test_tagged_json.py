"""The ``tagged_json`` constraint (a JSON value between fixed texts), as forced tool calls
use it: each format's call passes, a wrong name or schema-invalid arguments do not, and
the grammar ends right after the closing markup."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from radixserve.agents.registry import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat
from radixserve.agents.tool_grammar import forced_call
from radixserve.constrained import Constraint
from radixserve.constrained.grammar import GrammarCompiler
from radixserve.sampling_params import SamplingParams

FUNCS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
    {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
]


@pytest.fixture(scope="module")
def compiler(tiny_llama_dir: Path) -> GrammarCompiler:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    compiler = GrammarCompiler(tok, vocab_size=len(tok), stop_token_ids=[2])
    compiler.tok = tok  # type: ignore[attr-defined]
    return compiler


def accepts(compiler: Any, spec: str, text: str) -> bool:
    m = compiler.new_matcher(Constraint("tagged_json", spec))
    for t in compiler.tok.encode(text, add_special_tokens=False):
        if not m.accept(t):
            return False
    return m.can_only_end or m.is_terminated


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_forced_calls_in_each_format(compiler: Any, fmt: ToolFormat) -> None:
    spec = forced_call(fmt, FUNCS)
    assert SamplingParams(tagged_json=spec).validate().constraint == Constraint("tagged_json", spec)

    def call(obj: dict[str, Any]) -> str:
        return fmt.begin + json.dumps([obj] if fmt.array else obj) + fmt.end

    good = call({"name": "get_weather", fmt.args_key: {"city": "Paris"}})
    assert accepts(compiler, spec, good)
    assert not accepts(compiler, spec, call({"name": "nope", fmt.args_key: {}}))
    assert not accepts(compiler, spec, call({"name": "get_weather", fmt.args_key: {"c": 1}}))
    assert not accepts(compiler, spec, good + " more")
    only = forced_call(fmt, FUNCS[1:])  # a named function: the other is refused
    assert not accepts(compiler, only, good)


def test_bad_tagged_json_is_refused_before_compiling() -> None:
    for bad in ("not json", json.dumps({"begin": 1, "schema": {}}), json.dumps({"begin": ""})):
        with pytest.raises(ValueError, match="tagged_json"):
            SamplingParams(tagged_json=bad).validate()
