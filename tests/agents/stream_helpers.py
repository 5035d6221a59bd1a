"""Feeding a parser: an answer whole, and streamed in pieces (every split of it), with the
streamed deltas checked to add up to what the parser ends with."""

from __future__ import annotations

from radixserve.agents import reasoning as think
from radixserve.agents.stream import OutputParser, ToolScan


def run(scan: ToolScan | None, fmt: think.ThinkFormat | None, pieces: list[str]) -> dict:
    p = OutputParser(scan, fmt)
    content, reasoning, calls = "", "", {}
    for d in [*(p.feed(x) for x in pieces), p.finish()]:
        content += d.content
        reasoning += d.reasoning
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index == len(calls) and c.name
                calls[c.index] = [c.id, c.name, ""]
            calls[c.index][2] += c.arguments
    streamed = [tuple(v) for _, v in sorted(calls.items())]
    assert streamed == [tuple(c) for c in p.calls], "streamed calls differ from the final ones"
    assert content == p.content and reasoning == p.reasoning
    return {"content": content, "reasoning": reasoning, "calls": [(n, a) for _, n, a in streamed]}


def whole(scan: ToolScan | None, fmt: think.ThinkFormat | None, text: str) -> dict:
    p = OutputParser(scan, fmt)
    p.parse(text)
    return {"content": p.content, "reasoning": p.reasoning, "calls": [c[1:] for c in p.calls]}


def splits(text: str) -> list[list[str]]:
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    return out
