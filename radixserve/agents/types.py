"""The results parsers hand back: calls found in a model's text, and text-level deltas."""

from __future__ import annotations

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
