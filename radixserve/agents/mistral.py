"""Mistral tool calls, in either of the formats its tokenizers' versions write.

Before v11 (Mistral-7B-Instruct-v0.3, Mistral-Nemo): ``[TOOL_CALLS]`` then a JSON array of
call objects::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

An array that does not parse as calls is content at the end (``final``). IBM Granite 3.x
writes the same array after its own marker, ``<|tool_call|>`` (vLLM's ``granite`` parser):
:data:`granite_scan`.

From v11 on (Mistral Small 3.1 / 3.2, Magistral, Devstral, Ministral 3): each call is the
marker, the function's name, ``[ARGS]`` and the arguments' JSON object::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

(``[ARGS]`` is a special token, absent from the text where a detokenizer drops it: the name
then runs up to the ``{``.) One parser reads both, by what follows the first marker (a name,
or JSON), as vLLM's ``mistral`` parser does. Content is what precedes the first marker.
"""

from __future__ import annotations

import json
import re

from radixserve.agents.jsonscan import finished_call, named_call, read_call, skip_ws, value_end
from radixserve.agents.types import Scan, ScannedCall, held_marker_prefix

NAME = "mistral"
MARKER = "[TOOL_CALLS]"
GRANITE = "granite"
GRANITE_MARKER = "<|tool_call|>"
ARGS_KEYS = ("arguments", "parameters")
ARGS = "[ARGS]"
# A v11 call's name: what OpenAI allows in a function's name.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def scan(text: str, final: bool) -> Scan:
    """Mistral's calls (``[TOOL_CALLS]``), an array or (v11) named calls."""
    at = text.find(MARKER)
    i = skip_ws(text, at + len(MARKER))
    if at >= 0 and i < len(text) and text[i] not in "[{":
        return scan_named(text, at, final)
    return scan_after(MARKER, text, final)


def scan_named(text: str, at: int, final: bool) -> Scan:
    """v11 calls from ``text[at]`` (the first marker) on: ``[TOOL_CALLS]name[ARGS]{...}``,
    repeated. Text that is not such a call ends the calls; at the end (``final``) a call
    whose name or arguments do not read makes the whole text content."""
    content = text[:at]
    calls: list[ScannedCall] = []
    i = at
    while text.startswith(MARKER, i):
        start = i + len(MARKER)
        brace = text.find("{", start)
        if brace < 0:  # the name still being written (or never ending)
            if final or not _name_so_far(text[start:]):
                return Scan(text, []) if final else Scan(content, calls)
            calls.append(ScannedCall(None, "", False))
            return Scan(content, calls)
        name = text[start:brace].replace(ARGS, "").strip()
        if not _NAME.fullmatch(name):
            return Scan(text, []) if final else Scan(content, calls)
        end = value_end(text, brace)
        if end is None:
            if final:
                return Scan(text, [])
            calls.append(ScannedCall(name, text[brace:], False))
            return Scan(content, calls)
        if not _is_object(text[brace:end]):
            return Scan(text, []) if final else Scan(content, calls)
        calls.append(ScannedCall(name, text[brace:end], True))
        i = skip_ws(text, end)
    rest = text[i:]
    hold = 0 if final else held_marker_prefix(rest, (MARKER,))
    return Scan(content + rest[: len(rest) - hold], calls)


def _name_so_far(raw: str) -> bool:
    """Whether ``raw`` (after a marker, no ``{`` yet) can still become ``name[ARGS]``."""
    head = raw[: len(raw) - held_marker_prefix(raw, (ARGS,))].replace(ARGS, "").strip()
    return not head or _NAME.fullmatch(head) is not None


def _is_object(value: str) -> bool:
    try:
        return isinstance(json.loads(value), dict)
    except (ValueError, RecursionError):
        return False


def granite_scan(text: str, final: bool) -> Scan:
    """Granite 3.x's calls (``<|tool_call|>``)."""
    return scan_after(GRANITE_MARKER, text, final)


def scan_after(marker: str, text: str, final: bool) -> Scan:
    """Content up to ``marker``, then the JSON array of calls after it."""
    at = text.find(marker)
    if at < 0:
        hold = 0 if final else held_marker_prefix(text, (marker,))
        return Scan(text[: len(text) - hold], [])
    content = text[:at]
    i = skip_ws(text, at + len(marker))
    if i >= len(text):
        return Scan(text if final else content, [])
    single = text[i] == "{"  # some fine-tunes write one object without the array
    if text[i] != "[" and not single:
        return Scan(text, [])
    calls: list[ScannedCall] = []
    i = i if single else skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "]" and not single:
            return Scan(content, calls)
        end = value_end(text, i)
        if end is None:
            if final:
                return Scan(text, [])
            try:
                name, args, _ = read_call(text, i, ARGS_KEYS)
            except ValueError:
                return Scan(content, calls)
            calls.append(ScannedCall(name, args, False))
            return Scan(content, calls)
        call = finished_call(text[i:end], ARGS_KEYS)
        if call is None and not final:
            call = named_call(text[i:end], ARGS_KEYS)
        if call is None:
            return Scan(text, []) if final else Scan(content, calls)
        calls.append(ScannedCall(call[0], call[1], True))
        if single:
            return Scan(content, calls)
        i = skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i = skip_ws(text, i + 1)
    if final and not single:
        # The array never closed: keep the calls that did, if any.
        return Scan(content, calls) if calls else Scan(text, [])
    return Scan(content, calls)
