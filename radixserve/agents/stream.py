"""One request's generated text, split into content, reasoning and tool calls as it grows.

:class:`OutputParser` keeps the whole text, re-reads it with the format's pure
``scan``/``split`` functions after each delta, and hands back only what is new, so every
format is written once (as a function of the text) and streaming and non-streaming agree
by construction. Re-reading is linear in the text per delta; answers are bounded by
``max_tokens`` and tool-call answers are short, and a parser only runs for requests
that sent ``tools`` or on a server started with a reasoning parser.

A streamed call is announced (index, id, name) once its name is complete, then its
arguments follow as fragments. Content that may still turn into markup (``<tool_c``) is
held back until the next delta decides.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from radixserve.agents import reasoning as think
from radixserve.agents.types import OutputDelta, Scan, ToolCall, ToolCallDelta

ToolScan = Callable[[str, bool], Scan]


def new_call_id() -> str:
    """An OpenAI-style call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


class OutputParser:
    """Feeds text deltas through a reasoning format (optional) and a tool scan (optional).

    ``tools``: the tool parser's ``scan``, or ``None`` when the request has no tools (all
    answer text is content). ``think``: the reasoning format, or ``None``.
    """

    def __init__(self, tools: ToolScan | None, think_format: think.ThinkFormat | None) -> None:
        self.tools = tools
        self.think = think_format
        self.text = ""
        self._content = 0  # characters of content sent
        self._reasoning = 0
        self._ids: list[str] = []  # ids of the calls announced
        self._args: list[int] = []  # argument characters sent per call
        self.calls: list[ToolCall] = []  # filled by finish()
        self.content = ""
        self.reasoning = ""

    def feed(self, delta: str) -> OutputDelta:
        """What ``delta`` adds (some of it may be held back until later)."""
        self.text += delta
        return self._diff(final=False)

    def parse(self, text: str) -> None:
        """Read a whole answer at once (no stream): malformed calls become content."""
        self.text = text
        self.finish()

    def finish(self) -> OutputDelta:
        """The rest, once the generation has ended; :attr:`calls`, :attr:`content` and
        :attr:`reasoning` then hold the whole answer."""
        return self._diff(final=True)

    def _diff(self, final: bool) -> OutputDelta:
        reasoning, answer = self.text, self.text
        if self.think is not None:
            reasoning, answer = think.split(self.think, self.text, final)
        else:
            reasoning = ""
        if self.tools is not None:
            scanned = self.tools(answer, final)
            if final and sum(c.name is not None for c in scanned.calls) < len(self._ids):
                # A call already announced on the stream turned out malformed: it stays a
                # call (what was sent cannot be taken back), its markup out of the content.
                scanned = self.tools(answer, False)
        else:
            scanned = Scan(answer, [])
        content_delta = scanned.content[self._content :]
        reasoning_delta = reasoning[self._reasoning :]
        self._content = max(self._content, len(scanned.content))
        self._reasoning = max(self._reasoning, len(reasoning))
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(scanned.calls):
            if call.name is None:
                break  # announced in order: a later call waits for this one's name
            if index >= len(self._ids):
                self._ids.append(new_call_id())
                self._args.append(0)
                first = True
            else:
                first = False
            fragment = call.arguments[self._args[index] :]
            if first or fragment:
                deltas.append(
                    ToolCallDelta(
                        index,
                        self._ids[index] if first else None,
                        call.name if first else None,
                        fragment,
                    )
                )
                self._args[index] = max(self._args[index], len(call.arguments))
        if final:
            self.content = scanned.content
            self.reasoning = reasoning
            self.calls = [
                ToolCall(self._ids[i], c.name, c.arguments)
                for i, c in enumerate(scanned.calls)
                if c.name is not None and i < len(self._ids)
            ]
        return OutputDelta(content_delta, reasoning_delta, tuple(deltas))
