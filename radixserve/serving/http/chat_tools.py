"""Tools and reasoning in the OpenAI chat API: what a request asks for, checked and planned.

The request's ``tools`` go into the model's chat template (rendered in the router, with
the history's ``tool_calls`` and ``tool`` turns); the answer is read back by the tool
parser of the template's format (``--tool-call-parser`` overrides the guess) and by the
server's reasoning parser (``--reasoning-parser``). ``tool_choice``:

- ``"auto"`` (the default with tools): the model may write calls; they are parsed out.
- ``"none"``: tools are still rendered (the prompt, and so its cached prefix, stays the
  same across turns), nothing is parsed as a call.
- ``"required"`` / a named function: one call is forced with a ``tagged_json``
  constraint in the format's own markup (:mod:`radixserve.agents.tool_grammar`), its
  arguments valid against the function's schema. ``"required"`` with
  ``parallel_tool_calls`` (OpenAI's default) allows several calls instead, through a
  structural tag (:mod:`radixserve.agents.tool_tags`).
- ``strict: true`` tools under ``"auto"``, or ``parallel_tool_calls: false``: a structural
  tag leaves the text free but, once the model opens a call, holds it to a known tool
  with a strict tool's arguments valid against its schema, and ends generation after
  the first call when parallel calls are off. (With a structured output also asked for,
  ``response_format`` or another spelling of it, that constraint wins and the structural
  tag is not applied.)

gpt-oss's harmony format (its template's markup, or ``--tool-call-parser gpt-oss``) is read
for reasoning too when no ``--reasoning-parser`` is named, with or without tools in the
request, and keeps the special tokens in the text: its markers are special tokens.

A chat template that does not render tools (the default SmolLM2's) gets a 400 for any
``tool_choice`` but ``"none"`` (which then drops the tools): a tool list the model never
sees would only look supported. Sizes are checked before anything proportional to them.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from radixserve.agents import reasoning as think
from radixserve.agents import tool_tags
from radixserve.agents.registry import (
    ToolFormat,
    implied_reasoning,
    keeps_special_tokens,
    reasoning_format,
    renders_tools,
    served_tool_format,
)
from radixserve.agents.stream import OutputParser, ToolScan
from radixserve.constrained.spec import MAX_CONSTRAINT_CHARS
from radixserve.sampling_params import SamplingParams
from radixserve.serving.http.errors import invalid

#: OpenAI's own limit on the tools of one request.
MAX_TOOLS = 128
#: The most characters of all tools together, as JSON (each schema is also bounded by the
#: constraint limit when it is forced).
MAX_TOOLS_CHARS = 256 << 10
#: The most messages of one chat request (a long agent history is hundreds).
MAX_MESSAGES = 4096
#: The most characters of ``chat_template_kwargs`` as JSON.
MAX_TEMPLATE_KWARGS_CHARS = 4096
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionIn(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(_Strict):
    type: str = "function"
    function: FunctionIn


class FunctionRef(_Strict):
    name: str


class CallIn(_Strict):
    """An earlier assistant turn's call, as the client sends it back."""

    id: str = Field(max_length=256)
    type: str = "function"
    function: dict[str, Any]


class ToolPlan(NamedTuple):
    """How one chat request treats tools and reasoning."""

    tools_json: str | None  # rendered into the template
    parse_with: ToolScan | None  # tool parser of the answer (None: all content)
    forced: str | None  # tagged_json constraint forcing one call
    think: think.ThinkFormat | None
    # Structural tag (see tool_tags): strict arguments under auto, several forced calls,
    # one call at most; applied instead of ``forced`` when set (see :func:`constrain`).
    structural_tag: str | None = None
    # The answer's markup is special tokens (harmony's ``<|channel|>``...): the text must
    # keep them for the parsers to read it (``skip_special_tokens`` off, as SGLang does).
    special_tokens: bool = False


def after_prefill(plan: ToolPlan, prefill: str) -> ToolPlan:
    """``plan`` for an answer that goes on with ``prefill`` (the text of a reply the client
    began): its reasoning split starts where the prefill left it (:func:`think.after_prefill`)."""
    if plan.think is None:
        return plan
    return plan._replace(think=think.after_prefill(plan.think, prefill))


def _functions(tools: list[ToolIn]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if t.type != "function":
            raise invalid(
                f"tools[{i}].type {t.type!r} is not supported (only 'function')", param="tools"
            )
        if not _NAME.match(t.function.name):
            raise invalid(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-', '.' or ':'",
                param="tools",
            )
        out.append(t.function.model_dump(exclude_none=True))
    return out


def plan(
    tools: list[ToolIn] | None,
    tool_choice: str | dict[str, Any] | None,
    template: str | None,
    tool_parser: str | None,
    reasoning_parser: str | None,
    has_constraint: bool,
    parallel_tool_calls: bool | None = None,
) -> ToolPlan:
    """Check the request's tool fields against the model and server; raise a 400 on any
    that cannot be honoured. ``parallel_tool_calls``: ``None`` is OpenAI's default (on)."""
    # The served format reads answers with or without tools in the request: harmony's implies
    # its reasoning split (registry.implied_reasoning) and the special tokens kept.
    served = served_tool_format(tool_parser, template)
    think_fmt = (
        reasoning_format(reasoning_parser) if reasoning_parser else implied_reasoning(served)
    )
    tp = _plan(tools, tool_choice, template, served, think_fmt, has_constraint, parallel_tool_calls)
    return tp._replace(special_tokens=keeps_special_tokens(served, think_fmt))


def _plan(
    tools: list[ToolIn] | None,
    tool_choice: str | dict[str, Any] | None,
    template: str | None,
    served: ToolFormat | None,
    think_fmt: think.ThinkFormat | None,
    has_constraint: bool,
    parallel_tool_calls: bool | None,
) -> ToolPlan:
    """:func:`plan` once the served format and the reasoning format are known."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", param="tool_choice")
        return ToolPlan(None, None, None, think_fmt)
    functions, tools_json = _checked_tools(tools)
    choice, named = _checked_choice(tool_choice, [f["name"] for f in functions])
    if not renders_tools(template):
        if choice == "none":
            return ToolPlan(None, None, None, think_fmt)
        raise invalid(
            "the served model's chat template does not render tools, so the model would never "
            "see them; serve a model whose template does (Qwen2.5/Qwen3, Llama 3.1, Mistral), "
            'or send tool_choice "none"',
            param="tools",
        )
    fmt = served
    if fmt is None:
        raise invalid(
            "no tool-call parser matches the served model's chat template; start the server "
            "with --tool-call-parser (hermes, qwen3_coder, llama3_json, mistral, pythonic or "
            "gpt-oss)",
            param="tools",
        )
    if choice == "none":
        return ToolPlan(tools_json, None, None, think_fmt)
    parallel = parallel_tool_calls is not False
    _check_constrainable(fmt, choice, named, parallel, functions)
    forced = tag = None
    if choice == "required" or named is not None:
        if has_constraint:
            raise invalid(
                "a structured output (response_format, structured_outputs, guided_*, regex, "
                "ebnf) cannot be combined with a required tool call",
                param="tool_choice",
            )
        allowed = [f for f in functions if named is None or f["name"] == named]
        force = tool_tags.forced_calls(fmt, allowed, several=named is None and parallel)
        tag = (
            _bounded(force["structural_tag"], "force calls") if "structural_tag" in force else None
        )
        forced = _bounded(force["tagged_json"], "force a call") if "tagged_json" in force else None
    elif not has_constraint and (not parallel or any(f.get("strict") for f in functions)):
        tag = _bounded(tool_tags.auto_calls(fmt, functions, parallel), "enforce strict tools")
    return ToolPlan(tools_json, fmt.scanner(functions), forced, think_fmt, tag)


def _check_constrainable(
    fmt: ToolFormat, choice: Any, named: str | None, parallel: bool, functions: list[dict[str, Any]]
) -> None:
    """A 400 for what would need the format's calls constrained where they cannot be
    (pythonic calls under auto: one call at most, strict tools)."""
    if fmt.constrained:
        return
    forced = choice == "required" or named is not None
    needs = (
        ("a required tool call" if fmt.calls_grammar is None else None)
        if forced
        else "parallel_tool_calls false"
        if not parallel
        else "strict tools"
        if any(f.get("strict") for f in functions)
        else None
    )
    if needs is not None:
        raise invalid(
            f"{fmt.name} tool calls are not constrained here: {needs} cannot be enforced "
            "(send tool_choice auto)",
            param="tool_choice",
        )


def _checked_tools(tools: list[ToolIn]) -> tuple[list[dict[str, Any]], str]:
    """The tools' functions and the JSON the template renders (a 400 for too many, repeated
    names, or JSON past its size limit)."""
    if len(tools) > MAX_TOOLS:
        raise invalid(f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    functions = _functions(tools)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise invalid("tool names must be unique", param="tools")
    tools_json = json.dumps([{"type": "function", "function": f} for f in functions])
    if len(tools_json) > MAX_TOOLS_CHARS:
        raise invalid(
            f"tools take {len(tools_json)} characters as JSON, more than {MAX_TOOLS_CHARS}",
            param="tools",
        )
    return functions, tools_json


def _checked_choice(
    tool_choice: str | dict[str, Any] | None, names: list[str]
) -> tuple[str | dict[str, Any], str | None]:
    """``tool_choice`` (``"auto"`` when absent) and the function it names, if it names one
    of ``names`` (a 400 for any other shape or name)."""
    choice = "auto" if tool_choice is None else tool_choice
    if not isinstance(choice, dict):
        if choice not in ("none", "auto", "required"):
            raise invalid(
                f'tool_choice must be "none", "auto", "required" or a function, got {choice!r}',
                param="tool_choice",
            )
        return choice, None
    try:
        named: str | None = FunctionRef.model_validate(choice.get("function")).name
    except Exception:  # noqa: BLE001 - any shape error is the same 400
        named = None
    if choice.get("type", "function") != "function" or named is None:
        raise invalid(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if named not in names:
        raise invalid(f"tool_choice names {named!r}, which is not in tools", param="tool_choice")
    return choice, named


def _bounded(constraint: str, purpose: str) -> str:
    if len(constraint) > MAX_CONSTRAINT_CHARS:
        raise invalid(
            f"the schemas of the tools are too large to {purpose} "
            f"({len(constraint)} characters, limit {MAX_CONSTRAINT_CHARS})",
            param="tools",
        )
    return constraint


def constrain(params: SamplingParams, tp: ToolPlan) -> SamplingParams:
    """``params`` with the plan's tool constraint, if it has one, and the special tokens
    kept in the text where the parsers read them."""
    if tp.special_tokens and params.skip_special_tokens:
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    if tp.structural_tag is not None:
        return msgspec.structs.replace(params, structural_tag=tp.structural_tag)
    if tp.forced is not None:
        return msgspec.structs.replace(params, tagged_json=tp.forced)
    return params


# OpenAI's reasoning_effort values (chat completions' field, the Responses API's
# reasoning.effort).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def with_reasoning_effort(
    kwargs: dict[str, Any] | None, effort: Any, template: str | None, param: str
) -> dict[str, Any] | None:
    """``chat_template_kwargs`` with ``reasoning_effort`` for the template, as vLLM and SGLang
    hand it to templates that read it (gpt-oss's). A template that does not read it would
    ignore it: that is a 400 naming ``param``, not an answer at some other effort. A
    ``reasoning_effort`` in ``chat_template_kwargs`` itself stands."""
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise invalid(f"{param} must be one of {', '.join(REASONING_EFFORTS)}", param=param)
    if template is None or "reasoning_effort" not in template:
        raise invalid(
            f"the served model's chat template does not read reasoning_effort, so {param} would "
            'change nothing; send chat_template_kwargs (for example {"enable_thinking": false})',
            param=param,
        )
    return {"reasoning_effort": effort, **(kwargs or {})}


def template_kwargs(kwargs: dict[str, Any] | None) -> str | None:
    """``chat_template_kwargs`` as the JSON text the router renders with (size-checked)."""
    if not kwargs:
        return None
    text = json.dumps(kwargs)
    if len(text) > MAX_TEMPLATE_KWARGS_CHARS:
        raise invalid(
            f"chat_template_kwargs take {len(text)} characters, more than "
            f"{MAX_TEMPLATE_KWARGS_CHARS}",
            param="chat_template_kwargs",
        )
    return text


def output_parser(tp: ToolPlan) -> OutputParser | None:
    """A parser for one choice's answer, or ``None`` when the answer is all content."""
    if tp.parse_with is None and tp.think is None:
        return None
    return OutputParser(tp.parse_with, tp.think)


def message(tp: ToolPlan, text: str, finish_reason: str | None) -> tuple[dict[str, Any], Any]:
    """The non-streamed ``message`` of one choice, and its finish reason."""
    parser = output_parser(tp)
    if parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    parser.parse(text)
    out: dict[str, Any] = {"role": "assistant", "content": parser.content}
    if tp.think is not None:
        out["reasoning_content"] = parser.reasoning or None
    if parser.calls:
        out["content"] = parser.content or None
        out["tool_calls"] = [call_json(c.id, c.name, c.arguments) for c in parser.calls]
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return out, finish_reason


def call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def stream_delta(d: Any) -> dict[str, Any]:
    """An :class:`~radixserve.agents.types.OutputDelta` as an OpenAI ``delta`` (empty: {})."""
    out: dict[str, Any] = {}
    if d.reasoning:
        out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        calls = []
        for c in d.tool_calls:
            if c.id is not None:
                calls.append(
                    {
                        "index": c.index,
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                )
            else:
                calls.append({"index": c.index, "function": {"arguments": c.arguments}})
        out["tool_calls"] = calls
    return out
