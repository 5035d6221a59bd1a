"""Hermes-style tool calls, as Qwen2.5, Qwen3 and the Hermes models write them::

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text outside the ``<tool_call>`` blocks. A closed block that is not a call
object (bad JSON, no name) stays in the content as the model wrote it; so does an
unclosed one at the end, unless its body is a complete call (a model that stopped right
after the JSON).
"""

from __future__ import annotations

from radixserve.agents.jsonscan import finished_call, named_call, read_call, skip_ws
from radixserve.agents.types import Scan, ScannedCall, held_marker_prefix

NAME = "hermes"
START, END = "<tool_call>", "</tool_call>"
ARGS_KEYS = ("arguments", "parameters")


def scan(text: str, final: bool) -> Scan:
    """The content and calls in ``text``; ``final``: the generation has ended (nothing is
    held back, an unfinished block is judged as it stands)."""
    content: list[str] = []
    calls: list[ScannedCall] = []
    pos = 0
    while True:
        start = text.find(START, pos)
        if start < 0:
            rest = text[pos:]
            hold = 0 if final else held_marker_prefix(rest, (START,))
            content.append(rest[: len(rest) - hold])
            break
        content.append(text[pos:start])
        body_start = start + len(START)
        end = text.find(END, body_start)
        if end >= 0:
            call = finished_call(text[body_start:end], ARGS_KEYS)
            if call is None and not final:
                call = named_call(text[body_start:end], ARGS_KEYS)
            if call is None:
                content.append(text[start : end + len(END)])
            else:
                calls.append(ScannedCall(call[0], call[1], True))
            pos = end + len(END)
            continue
        body = text[body_start:]
        if final:
            call = finished_call(body, ARGS_KEYS)
            if call is None:
                content.append(text[start:])
            else:
                calls.append(ScannedCall(call[0], call[1], True))
        else:
            calls.append(_partial(body))
        break
    return Scan("".join(content), calls)


def _partial(body: str) -> ScannedCall:
    """A block still being generated: its name once complete, its arguments so far."""
    i = skip_ws(body, 0)
    if i >= len(body):
        return ScannedCall(None, "", False)
    try:
        name, args, _ = read_call(body, i, ARGS_KEYS)
    except ValueError:
        return ScannedCall(None, "", False)
    return ScannedCall(name, args, False)
