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
from radixserve.agents.types import Scan, ScannedCall, scan_blocks

NAME = "hermes"
START, END = "<tool_call>", "</tool_call>"
ARGS_KEYS = ("arguments", "parameters")


def scan(text: str, final: bool) -> Scan:
    """The content and calls in ``text``; ``final``: the generation has ended (nothing is
    held back, an unfinished block is judged as it stands)."""
    return scan_blocks(text, final, START, END, _read_block)


def _read_block(body: str, closed: bool, final: bool) -> ScannedCall | None:
    if not (closed or final):
        return _partial(body)
    call = finished_call(body, ARGS_KEYS)
    if call is None and closed and not final:  # named, then malformed: stays a call
        call = named_call(body, ARGS_KEYS)
    return None if call is None else ScannedCall(call[0], call[1], True)


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
