"""Pythonic tool calls: the answer is a Python list of calls with keyword arguments::

    [get_weather(city="Paris", unit="celsius"), get_time(zone="UTC")]

(Llama 3.2's and Llama 4's format, vLLM's ``pythonic`` and ``llama4_pythonic`` parsers;
Llama 4 may wrap the list in ``<|python_start|>`` ... ``<|python_end|>``.) Each argument's
value is a Python literal (strings, numbers, ``True``/``False``/``None``, lists, dicts),
read with ``ast.literal_eval`` (never evaluated as code) and handed on as JSON. An answer
that does not open with the list is content; a list that does not parse as such calls is
content at the end (``final``). While streaming, a call is named once its ``(`` is
written and its arguments come whole once its ``)`` is.
"""

from __future__ import annotations

import ast
import json

from radixserve.agents.types import Scan, ScannedCall, held_marker_prefix

NAME = "pythonic"
START, END = "<|python_start|>", "<|python_end|>"
QUOTES = "'\""


def scan(text: str, final: bool) -> Scan:
    lead = len(text) - len(text.lstrip())
    body = text[lead:]
    if body.startswith(START):
        body = body[len(START) :].lstrip()
    elif not final and START.startswith(body):
        return Scan("", [])  # maybe the wrapper, still arriving
    if not body.startswith("["):
        if not final and not body:
            return Scan("", [])
        return Scan(text, [])
    segments, closed_at = _segments(body)
    calls: list[ScannedCall] = []
    for segment, complete in segments:
        call = _call(segment) if complete else None
        if call is None:
            if final:
                return Scan(text, [])
            named = _named(segment)  # still being written (or not a call: decided at the end)
            return Scan("", calls if named is None else [*calls, named])
        calls.append(call)
    if closed_at is None:
        if final:
            return Scan(text, [])  # the list never closed
        return Scan("", calls)
    rest = body[closed_at + 1 :].strip()
    if rest.startswith(END):
        rest = rest[len(END) :].strip()
    elif not final and rest and END.startswith(rest):
        rest = ""
    if final and not calls:
        return Scan(text, [])
    hold = 0 if final else held_marker_prefix(rest, (END,))
    return Scan(rest[: len(rest) - hold], calls)


def _segments(body: str) -> tuple[list[tuple[str, bool]], int | None]:
    """The list's items as text, each with whether it is complete (a comma or the closing
    bracket after it), and where the list closes (None: not yet)."""
    out: list[tuple[str, bool]] = []
    depth, quote, start, i = 0, "", 1, 1
    while i < len(body):
        c = body[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in QUOTES:
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}" and depth > 0:
            depth -= 1
        elif c in ",]" and depth == 0:
            item = body[start:i].strip()
            if item:
                out.append((item, True))
            if c == "]":
                return out, i
            start = i + 1
        i += 1
    tail = body[start:].strip()
    if tail:
        out.append((tail, False))
    return out, None


def _call(segment: str) -> ScannedCall | None:
    """A complete ``name(key=literal, ...)``, its arguments as JSON; None if it is not one."""
    try:
        node = ast.parse(segment, mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        if None in args:  # **kwargs
            return None
        return ScannedCall(
            node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False), True
        )
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def _named(segment: str) -> ScannedCall | None:
    """A call still being written: named once its ``(`` is (its arguments yet to come)."""
    name, paren, _ = segment.partition("(")
    if not paren:
        return ScannedCall(None, "", False) if name.isidentifier() or not name else None
    return ScannedCall(name, "", False) if name.strip().isidentifier() else None
