"""The results parsers hand back: calls found in a model's text, and text-level deltas."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class ScannedCall(NamedTuple):
    """One tool call as far as the text shows it.

    ``name`` is ``None`` until the name's string is complete; ``arguments`` is the raw JSON
    text of the arguments generated so far (a prefix of the final text while ``complete``
    is false); ``complete``: the call's JSON (and its closing markup, if any) has ended.
    """

    name: str | None
    arguments: str
    complete: bool


class Scan(NamedTuple):
    """What a tool parser read from a text: the plain ``content`` (markup removed, and when
    not final, a trailing piece that may yet become markup held back) and the ``calls``."""

    content: str
    calls: list[ScannedCall]


class ToolCall(NamedTuple):
    """A finished call: ``arguments`` is JSON text, as OpenAI's ``function.arguments`` is."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One step of a streamed call (OpenAI's ``delta.tool_calls[i]``): ``id`` and ``name``
    on its first delta only, then ``arguments`` fragments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


class OutputDelta(NamedTuple):
    """What one chunk of generated text adds to each channel."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


def held_marker_prefix(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could be the start of one of ``markers``
    (held back from streamed content until the next characters decide)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


#: Reads one call block's body: ``(body, closed, final)`` -> the call it holds, or ``None``
#: where the block stays content. A block neither closed nor final is still being written:
#: the reader gives a call for it (nameless until its name is complete), never ``None``.
BlockReader = Callable[[str, bool, bool], "ScannedCall | None"]


def scan_blocks(text: str, final: bool, start: str, end: str, read: BlockReader) -> Scan:
    """The content and calls of a format whose calls are ``start`` ... ``end`` blocks, each
    block's body judged by ``read``; content is the text outside them (and the blocks
    ``read`` refuses). ``final``: the generation has ended (nothing is held back)."""
    content: list[str] = []
    calls: list[ScannedCall] = []
    pos = 0
    while True:
        begin = text.find(start, pos)
        if begin < 0:
            rest = text[pos:]
            hold = 0 if final else held_marker_prefix(rest, (start,))
            content.append(rest[: len(rest) - hold])
            break
        content.append(text[pos:begin])
        body_start = begin + len(start)
        stop = text.find(end, body_start)
        closed = stop >= 0
        block_end = stop + len(end) if closed else len(text)
        call = read(text[body_start : stop if closed else len(text)], closed, final)
        if call is None:
            content.append(text[begin:block_end])
        else:
            calls.append(call)
        if not closed:
            break
        pos = block_end
    return Scan("".join(content), calls)
