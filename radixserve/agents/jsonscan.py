"""Reading JSON that a model is still generating: where a value ends, if it has ended.

A streamed tool call's arguments are sent as they are generated, so the parser must know
which characters already belong to the arguments value (all of them, while the value is
open) and where the value stopped (then what follows is the call's own closing markup).
Linear in the text; no recursion, so deep nesting cannot overflow the stack.
"""

from __future__ import annotations

import json
from typing import NamedTuple

_WS = " \t\r\n"
_SCALAR = set("0123456789+-.eEtruefalsn")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index after the JSON string starting at ``text[i] == '"'``; ``None`` if unfinished."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at ``text[i]`` (no leading whitespace), or
    ``None`` when the text ends before the value does. Not a validator: it finds where a
    well-formed value would end; ``json.loads`` judges it afterwards."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    while i < len(text) and text[i] in _SCALAR:
        i += 1
    return i if i < len(text) else None


class Member(NamedTuple):
    """One top-level member of an object: its value's span (``end`` ``None`` while open)."""

    start: int
    end: int | None


class PartialObject(NamedTuple):
    """The members of a (possibly unfinished) object, and where the object ends."""

    members: dict[str, Member]
    end: int | None


def partial_object(text: str, i: int) -> PartialObject | None:
    """The top-level members of the object starting at ``text[i] == '{'`` as far as the
    text goes; ``None`` when the text there is not the start of an object."""
    if i >= len(text) or text[i] != "{":
        return None
    members: dict[str, Member] = {}
    i = skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            return PartialObject(members, i + 1)
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            return None
        key_end = string_end(text, i)
        if key_end is None:
            break
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return None
        i = skip_ws(text, key_end)
        if i >= len(text):
            break
        if text[i] != ":":
            return None
        start = skip_ws(text, i + 1)
        if start >= len(text):
            break
        end = value_end(text, start)
        members[key] = Member(start, end)
        if end is None:
            break
        i = skip_ws(text, end)
    return PartialObject(members, None)


def read_call(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[str | None, str, int | None]:
    """``(name, raw arguments so far, end of the object)`` of a call object at ``text[i]``
    (``{"name": ..., "arguments": ...}``; ``args_keys`` names the arguments member).
    The name is ``None`` until its string is complete; arguments are ``""`` until their
    value starts. Raises ``ValueError`` when the text cannot be a call object."""
    obj = partial_object(text, i)
    if obj is None:
        raise ValueError("not a JSON object")
    name: str | None = None
    m = obj.members.get("name")
    if m is not None and m.end is not None:
        value = json.loads(text[m.start : m.end])
        if not isinstance(value, str):
            raise ValueError("the call's name is not a string")
        name = value
    arguments = ""
    for key in args_keys:
        a = obj.members.get(key)
        if a is not None:
            arguments = text[a.start : a.end if a.end is not None else len(text)]
            break
    return name, arguments, obj.end


def finished_call(body: str, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of a complete call object, or ``None`` when the
    body is not one (malformed JSON, no string name, arguments not an object)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    start = skip_ws(body, 0)
    _, raw, _ = read_call(body, start, args_keys)
    args: object = next((obj[k] for k in args_keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return obj["name"], raw.strip() or "{}"


def named_call(body: str, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, raw arguments)`` of a call object whose name reads, valid or not: while
    streaming, a call already announced stays a call when its arguments turn out bad."""
    try:
        name, args, _ = read_call(body, skip_ws(body, 0), args_keys)
    except ValueError:
        return None
    return None if name is None else (name, args)
