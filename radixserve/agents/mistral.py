"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON array of call objects::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

(The format of Mistral-7B-Instruct-v0.3 and Mistral-Nemo with their published tool
templates.) Content is what precedes the marker. An array that does not parse as calls
is content at the end (``final``). IBM Granite 3.x writes the same array after its own
marker, ``<|tool_call|>`` (vLLM's ``granite`` parser): :data:`granite_scan`.
"""

from __future__ import annotations

from radixserve.agents.jsonscan import finished_call, named_call, read_call, skip_ws, value_end
from radixserve.agents.types import Scan, ScannedCall, held_marker_prefix

NAME = "mistral"
MARKER = "[TOOL_CALLS]"
GRANITE = "granite"
GRANITE_MARKER = "<|tool_call|>"
ARGS_KEYS = ("arguments", "parameters")


def scan(text: str, final: bool) -> Scan:
    """Mistral's calls (``[TOOL_CALLS]``)."""
    return scan_after(MARKER, text, final)


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
