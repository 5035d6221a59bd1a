"""Llama 3.1 / 3.2 JSON tool calls: the whole answer is one call object (or several,
separated by ``;``), optionally after the ``<|python_tag|>`` token::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

An answer that does not start with ``{`` (or the tag) is plain content. One that does but
does not parse as call objects is returned as content at the end (``final``).
"""

from __future__ import annotations

from radixserve.agents.jsonscan import finished_call, named_call, read_call, skip_ws, value_end
from radixserve.agents.types import Scan, ScannedCall

NAME = "llama3_json"
PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")


def scan(text: str, final: bool) -> Scan:
    i = skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, i):
        i = skip_ws(text, i + len(PYTHON_TAG))
    elif not final and PYTHON_TAG.startswith(text[i:]) and i < len(text):
        return Scan("", [])  # maybe the tag, still arriving
    if i >= len(text):
        return Scan("" if not final else text, [])
    if text[i] != "{":
        return Scan(text, [])
    calls: list[ScannedCall] = []
    while i < len(text):
        end = value_end(text, i)
        if end is None:
            if final:
                return Scan(text, [])
            try:
                name, args, _ = read_call(text, i, ARGS_KEYS)
            except ValueError:
                return Scan(text, [])
            calls.append(ScannedCall(name, args, False))
            break
        call = finished_call(text[i:end], ARGS_KEYS)
        if call is None and not final:
            call = named_call(text[i:end], ARGS_KEYS)
        if call is None:
            return Scan(text, []) if final else Scan("", calls)
        calls.append(ScannedCall(call[0], call[1], True))
        i = skip_ws(text, end)
        if i < len(text) and text[i] == ";":
            i = skip_ws(text, i + 1)
        elif i < len(text):
            return Scan(text, []) if final else Scan("", calls)
    return Scan("", calls)
