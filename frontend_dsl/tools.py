"""Tools in prompt programs: declare functions, let ``gen`` return a call, append the result.

```python
weather = tool("get_weather", "Weather of a city", {"type": "object", "properties":
               {"city": {"type": "string"}}, "required": ["city"]}, strict=True)

@program
def agent(s, question):
    s += system("You are a helpful agent.", tools=[weather])  # the template renders the tools
    s += user(question)
    s += assistant(gen("step", tools=[weather], tool_choice="required"))
    for call in s["step"].calls:                               # parsed: name, JSON arguments
        s += tool_result(call, lookup(call))                   # a tool turn, as the template writes it
    s += assistant(gen("answer"))
```

A ``gen`` with ``tools`` stores a :class:`ToolReply` (content, calls, raw text). The calls
are read by the same parser the HTTP API uses (:mod:`radixserve.agents`), chosen from the
model's chat template (or ``tool_parser=``); ``tool_choice`` ``"required"``, a function
name, ``strict`` tools and ``parallel_tool_calls=False`` are enforced with the same
constraints (:mod:`radixserve.agents.tool_tags`). The state appends exactly what the model
wrote, so every turn's prompt extends the previous one and the radix cache reuses it.

The text around the declared tools and around a tool result comes from rendering the
model's template with sentinels (as :class:`~frontend_dsl.chat_template.RoleFormat` does
for roles); templates that render tools in the system turn (Hermes / Qwen2.5 / Qwen3) are
supported, others raise a ``ValueError`` that says so. Each tool result is one turn of its
own (a template that groups consecutive results renders them as one turn: one call per
turn, ``parallel_tool_calls=False``, keeps the two identical).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from frontend_dsl.chat_template import render_chat_template
from radixserve.agents.registry import ToolFormat, guess_tool_format, tool_format
from radixserve.agents.stream import OutputParser
from radixserve.agents.tool_tags import auto_calls, forced_calls
from radixserve.agents.types import ToolCall

__all__ = ["ToolMarkers", "ToolReply", "ToolUse", "tool", "tools_json", "tool_markers"]

_SYS, _RES = "XTOOLSYSX", "XTOOLRESX"


def tool(
    name: str,
    description: str = "",
    parameters: Mapping[str, Any] | None = None,
    *,
    strict: bool = False,
) -> dict[str, Any]:
    """A function the model may call, in OpenAI's ``tools`` shape. ``strict``: its arguments
    are held to ``parameters`` whenever the model calls it (not only when a call is forced)."""
    fn: dict[str, Any] = {"name": name, "description": description}
    fn["parameters"] = dict(parameters or {"type": "object", "properties": {}})
    if strict:
        fn["strict"] = True
    return {"type": "function", "function": fn}


def tools_json(tools: Sequence[Mapping[str, Any]]) -> str:
    """The canonical JSON text of a tool list (a hashable key; what the template renders)."""
    out = []
    for t in tools:
        fn = t.get("function") if t.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(
                f"a tool must be {{'type': 'function', 'function': {{'name': ...}}}}: {t!r}"
            )
        out.append({"type": "function", "function": dict(fn)})
    return json.dumps(out)


@dataclass(frozen=True)
class ToolReply:
    """What a ``gen`` with tools produced: the content (markup removed), the calls, the text."""

    content: str
    calls: list[ToolCall]
    text: str

    @property
    def call(self) -> ToolCall | None:
        """The first call, or ``None`` when the model answered without one."""
        return self.calls[0] if self.calls else None

    def arguments(self, index: int = 0) -> dict[str, Any]:
        """Call ``index``'s arguments, parsed."""
        return json.loads(self.calls[index].arguments)


@dataclass(frozen=True)
class ToolUse:
    """The tool side of one ``gen``: the tools (JSON text), the choice, parallel calls, parser."""

    tools: str
    choice: str = "auto"  # "auto", "required", or a function name
    parallel: bool = True
    parser: str | None = None

    def functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in json.loads(self.tools)]

    def format(self, template: str | None) -> ToolFormat:
        fmt = tool_format(self.parser) if self.parser else guess_tool_format(template)
        if fmt is None:
            raise ValueError(
                "the model's chat template has no tool-call format radixserve knows; pass "
                "gen(..., tool_parser='hermes' | 'qwen3_coder' | 'llama3_json' | 'mistral')"
            )
        return fmt

    def constraint(self, fmt: ToolFormat) -> dict[str, str]:
        """The SamplingParams constraint field this choice needs (empty: none)."""
        functions = self.functions()
        if self.choice == "required":
            return forced_calls(fmt, functions, self.parallel)
        if self.choice != "auto":
            named = [f for f in functions if f["name"] == self.choice]
            if not named:
                raise ValueError(f"tool_choice {self.choice!r} is not one of the tools")
            return forced_calls(fmt, named, False)
        if not self.parallel or any(f.get("strict") for f in functions):
            return {"structural_tag": auto_calls(fmt, functions, self.parallel)}
        return {}

    def read(self, fmt: ToolFormat, text: str) -> ToolReply:
        parser = OutputParser(fmt.scanner(self.functions()), None)
        parser.parse(text)
        return ToolReply(parser.content, list(parser.calls), text)


@dataclass(frozen=True)
class ToolMarkers:
    """The text around a system turn that declares tools, and around a tool result."""

    system_prefix: str
    system_suffix: str
    result_prefix: str
    result_suffix: str


@functools.lru_cache(maxsize=64)
def tool_markers(
    template: str | None, tools: str, special: tuple[tuple[str, str], ...] = ()
) -> ToolMarkers:
    """Render ``template`` with sentinels to find the markers (``tools``: JSON text)."""
    if not template or "tools" not in template:
        raise ValueError("the model's chat template does not render tools")
    listed = json.loads(tools)

    def render(msgs: list[dict[str, Any]]) -> str:
        return render_chat_template(template, msgs, special_tokens=dict(special), tools=listed)

    def around(before: str, after: str, sentinel: str) -> tuple[str, str]:
        if not after.startswith(before) or after.count(sentinel) != 1:
            raise ValueError(
                "the model's chat template does not render tools in the system turn, so a "
                "program cannot append them (templates like Qwen's and Hermes' do)"
            )
        head, tail = after[len(before) :].split(sentinel)
        return head, tail

    sys_prefix, sys_suffix = around("", render([{"role": "system", "content": _SYS}]), _SYS)
    name = listed[0]["function"]["name"]
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": {}}}
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    result = {"role": "tool", "tool_call_id": "call_0", "name": name, "content": _RES}
    res_prefix, res_suffix = around(render(history), render(history + [result]), _RES)
    return ToolMarkers(sys_prefix, sys_suffix, res_prefix, res_suffix)
