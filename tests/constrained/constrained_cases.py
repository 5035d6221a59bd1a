"""Shared constraints and the tiny engine factory of the constrained-decoding tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixserve.engine.engine import Engine

IPV4_REGEX = r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"

# Nested objects, required fields, enums, arrays, numbers and booleans -- every string,
# number and array bounded, so a random model's sampled output has a bounded length and
# always finishes well inside max_tokens.
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "[A-Z][a-z]{1,6}"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 8},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "tags", "address"],
}

# A grammar (EBNF, as xgrammar reads it) with rules that refer to rules and parentheses
# nested to a bounded depth, and the same language as a regex, to check outputs against.
ARITH_EBNF = """root ::= expr
expr ::= term (op term){0,2}
term ::= num | "(" inner ")"
inner ::= num (op num){0,2}
op ::= " + " | " * "
num ::= [1-9] [0-9]?
"""
_NUM, _OP = "[1-9][0-9]?", r" [+*] "
_INNER = rf"{_NUM}({_OP}{_NUM}){{0,2}}"
_TERM = rf"({_NUM}|\({_INNER}\))"
ARITH_REGEX = rf"{_TERM}({_OP}{_TERM}){{0,2}}"


def make_tiny_engine(model_dir: Path, **kw: Any) -> Engine:
    cfg: dict[str, Any] = dict(
        page_size=4, num_pages=1024, max_num_tokens=512, max_running_requests=64, seed=0
    )
    cfg.update(kw)
    return Engine(str(model_dir), **cfg)
