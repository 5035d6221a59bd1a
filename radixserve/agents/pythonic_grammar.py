"""The grammar of forced pythonic calls (``tool_choice`` ``"required"`` or a named function
with Llama 3.2's and Llama 4's format, :mod:`.pythonic`): a Python list of calls, each
``name(key=literal, ...)`` with the function's parameters as keyword arguments::

    [get_weather(city="Paris", days=3), get_time(zone="UTC")]

xgrammar compiles JSON schemas to JSON, and these arguments are Python literals, so the
schema is spelled here as an EBNF grammar of them: strings (double-quoted, Python's escapes),
integers and numbers, ``True``/``False``, ``None``, lists of the ``items`` schema and dicts
of the ``properties`` (string keys), ``enum``/``const`` as the literals of their values,
``anyOf``/``oneOf`` and type lists as alternatives, strings' ``minLength``/``maxLength``.
Keyword arguments come in the schema's order, every required one present; a schema without
``properties`` takes any keyword arguments of any literal. What this grammar does not bound
(string patterns and formats, numeric ranges, item counts) is left to the tool, as it is
for a client's own parser.

The forced text is what :func:`.pythonic.scan` reads back, with ``", "`` between calls and
arguments, ``=`` without spaces, and no wrapper.
"""

from __future__ import annotations

import json
from typing import Any

# Any Python literal a JSON value reads back from (ast.literal_eval), and its parts.
_LITERALS = r"""
py_value ::= py_str | py_num | "True" | "False" | "None" | py_list | py_dict
py_list ::= "[" (py_value (", " py_value)*)? "]"
py_dict ::= "{" (py_str ": " py_value (", " py_str ": " py_value)*)? "}"
py_str ::= "\"" py_char* "\""
py_char ::= [^"\\\n\r] | "\\" ["\\'nrtbf] | "\\u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]
py_int ::= "-"? ("0" | [1-9] [0-9]*)
py_num ::= py_int ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
py_ident ::= [a-zA-Z_] [a-zA-Z0-9_]*
py_kwargs ::= (py_ident "=" py_value (", " py_ident "=" py_value)*)?
"""
MAX_DEPTH = 16  # nesting of a schema spelled exactly; deeper values are any literal
_SCALARS = {
    "string": "py_str",
    "integer": "py_int",
    "number": "py_num",
    "boolean": '("True" | "False")',
    "null": '"None"',
}


def calls_grammar(functions: list[dict[str, Any]], several: bool) -> str:
    """The EBNF of a list of calls of ``functions`` (OpenAI ``function`` objects): one or
    more with ``several``, else exactly one."""
    g = _Rules()
    calls = []
    for f in functions:
        params = f.get("parameters") or {}
        args = g.arguments(params, keyword=True)
        calls.append(f"{_quote(f['name'] + '(')} {args} {_quote(')')}")
    g.add("call", " | ".join(f"({c})" for c in calls))
    more = ' (", " call)*' if several else ""
    g.add("root", f'"[" call{more} "]"')
    return g.text()


def structural_tag(functions: list[dict[str, Any]], several: bool) -> str:
    """:func:`calls_grammar` as the structural tag a request's constraint carries."""
    grammar = {"type": "grammar", "grammar": calls_grammar(functions, several)}
    return json.dumps({"type": "structural_tag", "format": grammar})


def _quote(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes are EBNF's)."""
    return json.dumps(text, ensure_ascii=False)


def _literal(value: Any) -> str:
    """The Python literal of a JSON value, as an EBNF string literal."""
    return _quote(_python(value))


def _python(value: Any) -> str:
    """The Python literal of a JSON value, as the grammar writes literals (double-quoted
    strings, ``", "`` and ``": "`` between items)."""
    if isinstance(value, bool) or value is None:
        return {True: "True", False: "False", None: "None"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{json.dumps(k)}: {_python(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return json.dumps(value, ensure_ascii=False)  # a string (double-quoted) or a number


def _bounded_string(schema: dict[str, Any]) -> str:
    """A string of ``minLength`` to ``maxLength`` characters (an escape counts as one)."""
    low = max(0, int(schema.get("minLength", 0)))
    high = schema.get("maxLength")
    count = f"{{{low},}}" if high is None else f"{{{low},{max(low, int(high))}}}"
    return f'("\\"" py_char{count} "\\"")'


class _Rules:
    """Named rules, made as a schema is walked."""

    def __init__(self) -> None:
        self._rules: list[str] = []
        self._count = 0

    def add(self, name: str, body: str) -> str:
        self._rules.append(f"{name} ::= {body}")
        return name

    def new(self, body: str) -> str:
        self._count += 1
        return self.add(f"r{self._count}", body)

    def text(self) -> str:
        root = [r for r in self._rules if r.startswith("root ::=")]
        rest = [r for r in self._rules if not r.startswith("root ::=")]
        return "\n".join(root + rest) + "\n" + _LITERALS

    def value(self, schema: Any, depth: int = 0) -> str:
        """The rule (or expression) of a value of ``schema`` (nested ``depth`` deep; past
        :data:`MAX_DEPTH` any literal, so a hostile schema costs no recursion)."""
        if not isinstance(schema, dict) or depth > MAX_DEPTH:
            return "py_value"  # true, or a schema this grammar cannot read
        if "const" in schema:
            return _literal(schema["const"])
        if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
            return "(" + " | ".join(_literal(v) for v in schema["enum"]) + ")"
        options = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(options, list) and options:
            return "(" + " | ".join(self.value(o, depth + 1) for o in options) + ")"
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            alternatives = (self.value({**schema, "type": k}, depth + 1) for k in kind)
            return "(" + " | ".join(alternatives) + ")"
        if kind == "string" and ("minLength" in schema or "maxLength" in schema):
            return _bounded_string(schema)
        if kind in _SCALARS:
            return _SCALARS[kind]
        if kind == "array":
            item = self.value(schema.get("items", True), depth + 1)
            return self.new(f'"[" ({item} (", " {item})*)? "]"')
        if kind == "object" or "properties" in schema:
            return self.new(f'"{{" {self.arguments(schema, False, depth + 1)} "}}"')
        return "py_value"

    def arguments(self, schema: dict[str, Any], keyword: bool, depth: int = 0) -> str:
        """The rule of an object's members: keyword arguments (``key=value``) or a dict's
        items (``"key": value``), in the schema's order, the required ones present."""
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            if keyword:
                return "py_kwargs"
            return '(py_str ": " py_value (", " py_str ": " py_value)*)?'
        required = set(schema.get("required") or ())
        items = [
            (
                _quote(f"{k}=" if keyword else f"{json.dumps(k, ensure_ascii=False)}: "),
                self.value(v, depth),
                k in required,
            )
            for k, v in props.items()
        ]
        # rest_i: the members from i on, each after ", "; start_i: the first present from i
        # on (no comma), then rest.
        rest = start = '""'
        for key, value, needed in reversed(items):
            member = f"{key} {value}"
            new_rest = self.new(f'", " {member} {rest}' if needed else f'(", " {member})? {rest}')
            new_start = self.new(f"{member} {rest}" + ("" if needed else f" | {start}"))
            rest, start = new_rest, new_start
        return start
