"""Qwen's XML tool calls, as Qwen3-Coder (and Qwen3.5) write them::

    some text<tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text: a string as it stands (the newline after the opening tag
and the one before the closing tag are markup, as vLLM and SGLang read them: code keeps its
indentation and its last newline), anything else as JSON. The format's grammar (xgrammar's
``qwen_xml`` style, what forced calls follow) allows any whitespace around a value; where
a schema lists the values (``enum``), whitespace around one of them is read as markup. So reading the
arguments back as OpenAI's JSON needs the tools' parameter schemas (what vLLM's and
SGLang's ``qwen3_coder`` parsers do): a value whose schema says ``string`` stays text; an
``integer``, ``number``, ``boolean``, ``object`` or ``array`` (or a parameter the schema
does not type) is read as JSON, and stays text where it is not JSON.

Arguments stream a parameter at a time: ``{"city": "Paris"`` once ``</parameter>``
closes the first, and so on, ``}`` once ``</function>`` does; each is a prefix of the final
JSON text. Content is the text outside the ``<tool_call>`` blocks. A closed block that is
not a call (no ``<function=...>``, other text between the tags) stays in the content as the
model wrote it; so does an unclosed one at the end, unless its function closed (a model
that stopped right after ``</function>``). One whose name was streamed before its fault
showed stays a call, with the parameters read before it (a call announced on a stream
cannot be taken back).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from radixserve.agents.jsonscan import skip_ws
from radixserve.agents.types import Scan, ScannedCall, scan_blocks

NAME = "qwen3_coder"
START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
#: The markup around one call that names ``function``, as the format writes it.
CALL_BEGIN, CALL_END = "<tool_call>\n<function=", "\n</function>\n</tool_call>"

#: Each function's parameters' schemas, by function name and parameter name.
ParameterSchemas = Mapping[str, Mapping[str, Any]]

# A function or parameter name in the markup (GLM-4.5's too: glm_xml.py).
TAG_NAME = re.compile(r"[^<>\n]+")
_TEXT_TYPES = frozenset({"string", "str", "text"})


def parameter_schemas(functions: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The parameters' schemas of OpenAI ``function`` objects, by name (what :func:`scan`
    reads values with)."""
    out: dict[str, dict[str, Any]] = {}
    for f in functions:
        props = (f.get("parameters") or {}).get("properties") or {}
        out[f["name"]] = {k: v for k, v in props.items() if isinstance(v, dict)}
    return out


def scan(text: str, final: bool, params: ParameterSchemas | None = None) -> Scan:
    """The content and calls in ``text``; ``final``: the generation has ended (nothing is
    held back, an unfinished block is judged as it stands). ``params``: the tools'
    parameter schemas (:func:`parameter_schemas`); without them every value is read as
    JSON where it parses and as text where it does not."""
    schemas = params or {}
    return scan_blocks(text, final, START, END, lambda b, c, f: _read_block(b, c, f, schemas))


def _read_block(
    body: str, closed: bool, final: bool, schemas: ParameterSchemas
) -> ScannedCall | None:
    call = _read_call(body, schemas)
    if not (closed or final):  # still being written
        return ScannedCall(None, "", False) if call is None or call.trailing else call.scanned
    if call is not None and call.closed and not call.trailing:
        return call.scanned
    if closed and not final and call is not None and call.scanned.name is not None:
        # Named, then malformed: while streaming (and for a call already announced) it
        # stays a call, with the parameters read before the fault.
        return ScannedCall(call.scanned.name, _closed(call.scanned.arguments), True)
    return None


class _Call(NamedTuple):
    scanned: ScannedCall
    closed: bool  # </function> ended it
    trailing: bool  # text other than whitespace follows what was read


def _read_call(body: str, schemas: ParameterSchemas) -> _Call | None:
    """One block's call as far as ``body`` shows it; ``None`` where it is not a call."""
    i = skip_ws(body, 0)
    if not FUNCTION.startswith(body[i : i + len(FUNCTION)]):
        return None
    if len(body) - i < len(FUNCTION):
        return _Call(ScannedCall(None, "", False), False, False)
    name_end = body.find(">", i + len(FUNCTION))
    if name_end < 0:
        partial = body[i + len(FUNCTION) :]
        if partial and not TAG_NAME.fullmatch(partial):
            return None
        return _Call(ScannedCall(None, "", False), False, False)
    name = body[i + len(FUNCTION) : name_end]
    if not TAG_NAME.fullmatch(name):
        return None
    name = name.strip()
    types = schemas.get(name, {})
    args: list[str] = []
    i = name_end + 1
    while True:
        i = skip_ws(body, i)
        if body.startswith(FUNCTION_END, i):
            rest = body[i + len(FUNCTION_END) :]
            arguments = "{" + ", ".join(args) + "}"
            return _Call(ScannedCall(name, arguments, True), True, bool(rest.strip()))
        param = _read_parameter(body, i, types)
        if param is None:  # the rest is not (yet) a parameter or the function's end
            ahead = body[i:]
            stalled = any(tag.startswith(ahead) for tag in (FUNCTION_END, PARAMETER))
            return _Call(ScannedCall(name, "{" + ", ".join(args), False), False, not stalled)
        if param[1] is None:  # a parameter still being written
            return _Call(ScannedCall(name, "{" + ", ".join(args), False), False, False)
        args.append(param[1])
        i = param[0]


def _closed(arguments: str) -> str:
    """Arguments read so far (``{`` and whole parameters) as a JSON object."""
    return arguments if arguments.endswith("}") else arguments + "}"


def _read_parameter(body: str, i: int, types: Mapping[str, Any]) -> tuple[int, str | None] | None:
    """``<parameter=key>value</parameter>`` at ``i``: where it ends and its ``"key": value``
    JSON (``None`` while it is unfinished); ``None`` where ``i`` starts no parameter."""
    if not body.startswith(PARAMETER, i):
        return None
    key_end = body.find(">", i + len(PARAMETER))
    if key_end < 0:
        return len(body), None
    key = body[i + len(PARAMETER) : key_end]
    if not TAG_NAME.fullmatch(key):
        return None
    value_end = body.find(PARAMETER_END, key_end + 1)
    if value_end < 0:
        return len(body), None
    raw = body[key_end + 1 : value_end]
    value = read_value(raw, types.get(key.strip()))
    item = f"{json.dumps(key.strip(), ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
    return value_end + len(PARAMETER_END), item


def read_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's raw text as the JSON value its schema says it is (GLM-4.5's arguments
    too: ``glm_xml.py``)."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if schema and text.strip() in (schema.get("enum") or ()):
        return text.strip()  # whitespace around one of the listed values is markup
    if _is_text(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _is_text(schema: Mapping[str, Any] | None) -> bool:
    """Whether a parameter's schema makes its value a string (and only a string)."""
    if not schema:
        return False
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        return len(kinds) == 1 and kinds[0] in _TEXT_TYPES
    if kind is None and "enum" in schema:
        return all(isinstance(v, str) for v in schema["enum"])
    return kind in _TEXT_TYPES
