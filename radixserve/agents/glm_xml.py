"""GLM-4.5's tool calls (vLLM's and SGLang's ``glm45`` parser)::

    some text<tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The function's name follows the opening tag on its line; each argument is a key and a value
in their tags. A value is raw text, read as Qwen's XML parameters are
(:func:`radixserve.agents.qwen_xml.parameter_schemas`): a string where the tool's schema
says so, else JSON where it parses. Arguments stream an argument at a time, ``}`` once the
block closes. Content is the text outside the blocks; a closed block that is not a call (no
name, other text between the tags) stays in the content as the model wrote it, and so does
an unclosed one at the end of the generation; one whose name was streamed stays a call.
Forced calls follow xgrammar's ``glm_xml`` style of the arguments' schema
(``agents/tool_tags.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from radixserve.agents.jsonscan import skip_ws
from radixserve.agents.qwen_xml import TAG_NAME, ParameterSchemas, parameter_schemas, read_value
from radixserve.agents.types import Scan, ScannedCall, scan_blocks

__all__ = ["NAME", "START", "END", "scan", "parameter_schemas"]

NAME = "glm45"
START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"


def scan(text: str, final: bool, params: ParameterSchemas | None = None) -> Scan:
    """The content and calls in ``text`` (see the module docstring); ``params``: the tools'
    parameter schemas, by which values are read."""
    schemas = params or {}
    return scan_blocks(text, final, START, END, lambda b, c, f: _read_block(b, c, f, schemas))


def _read_block(
    body: str, closed: bool, final: bool, schemas: ParameterSchemas
) -> ScannedCall | None:
    read = _read_call(body, schemas, closed)
    if read is None:
        return None if closed or final else ScannedCall(None, "", False)
    name, args, whole = read
    if not (closed or final):  # still being written
        return ScannedCall(name, "{" + ", ".join(args), False)
    if closed and whole and name is not None:
        return ScannedCall(name, "{" + ", ".join(args) + "}", True)
    if closed and not final and name is not None:
        # Named, then malformed: a call already announced on a stream stays a call.
        return ScannedCall(name, "{" + ", ".join(args) + "}", True)
    return None


def _read_call(
    body: str, schemas: ParameterSchemas, closed: bool
) -> tuple[str | None, list[str], bool] | None:
    """The block's name (None while it is being written), its arguments as ``"key": value``
    JSON items, and whether the rest of it is only whitespace; None where it is no call.
    ``closed``: the block has ended (a name alone on its line is then whole)."""
    line_end = body.find("\n")
    first = body if line_end < 0 else body[:line_end]
    cut = first.find("<")
    name_text = first if cut < 0 else first[:cut]
    if not name_text.strip() or not TAG_NAME.fullmatch(name_text.strip()):
        return None
    if line_end < 0 and cut < 0:  # a call without arguments, or a name still growing
        return (name_text.strip(), [], True) if closed else (None, [], False)
    name = name_text.strip()
    types = schemas.get(name, {})
    args: list[str] = []
    i = len(name_text) if cut >= 0 else line_end
    while True:
        i = skip_ws(body, i)
        if i >= len(body):
            return name, args, True
        item = _read_argument(body, i, types)
        if item is None:
            return name, args, False
        i, arg = item
        if arg is None:
            return name, args, False  # an argument still being written
        args.append(arg)


def _read_argument(body: str, i: int, types: Mapping[str, Any]) -> tuple[int, str | None] | None:
    """``<arg_key>k</arg_key> <arg_value>v</arg_value>`` at ``i``: where it ends and its JSON
    item (``None`` while unfinished); None where ``i`` starts none."""
    if not body.startswith(KEY, i):
        return (len(body), None) if KEY.startswith(body[i:]) else None
    key_end = body.find(KEY_END, i + len(KEY))
    if key_end < 0:
        return len(body), None
    key = body[i + len(KEY) : key_end].strip()
    j = skip_ws(body, key_end + len(KEY_END))
    if not body.startswith(VALUE, j):
        return (len(body), None) if VALUE.startswith(body[j:]) else None
    value_end = body.find(VALUE_END, j + len(VALUE))
    if value_end < 0:
        return len(body), None
    raw = body[j + len(VALUE) : value_end]
    value = read_value(raw, types.get(key))
    item = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
    return value_end + len(VALUE_END), item
