"""Structural-tag constraints for tool calls: strict schemas under ``auto``, several forced calls.

An xgrammar structural tag (``{"type": "structural_tag", "format": ...}``, compiled by
:func:`radixserve.constrained.grammar.structural_tag_grammar`) describes text with tagged
regions. Each function is one tag: its ``begin`` is the format's markup up to the
arguments (``<tool_call>\\n{"name": "get_weather", "arguments": ``), its content the
arguments' JSON schema, its ``end`` the rest of the markup. So:

- ``tool_choice: "auto"`` with ``strict: true`` tools (``triggered_tags``): the model writes
  free text; once it writes the format's opening (the trigger, ``<tool_call>``), the call
  must name one of the tools and the arguments of a strict tool must be valid against its
  schema (a non-strict tool's arguments need only be a JSON object).
- ``"required"`` (``tags_with_separator``, at least one tag): only calls, every one's
  arguments valid; with ``parallel_tool_calls`` several (separated as the format separates
  them), without it exactly one.
- ``parallel_tool_calls: false``: generation stops after the first call.

The forced text is what the model writes unforced and what the templates render back
(``", "``/``": "`` separators, name before arguments), so the next turn reuses it from the
cache. Mistral's calls before v11 are one JSON array: one tag whose content is the array.
Its v11 calls name the function in the markup (``[TOOL_CALLS]get_weather[ARGS]``), then the
arguments' JSON; Qwen3-Coder's too (``<tool_call>\n<function=get_weather>\n``), then the
arguments as XML parameters: xgrammar's ``qwen_xml`` style of the arguments' schema.
gpt-oss's harmony calls name it in the message header
(``<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>``), then the
arguments' JSON and ``<|call|>``; several are separated by ``<|start|>assistant``. That is
how the model writes a call, not how gpt-oss's template renders it back (recipient first,
``<|start|>assistant to=functions.get_weather<|channel|>commentary json``): the next turn
reuses the prompt from the cache, not the call.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.agents.registry import ToolFormat
from radixserve.agents.tool_grammar import call_schema, forced_call

#: A non-strict tool's arguments under ``auto``: any JSON object.
LOOSE_ARGS: dict[str, Any] = {"type": "object"}


def _args_schema(function: dict[str, Any], enforce: bool) -> dict[str, Any]:
    if not enforce:
        return LOOSE_ARGS
    return function.get("parameters") or {"type": "object", "properties": {}}


def _tags(
    fmt: ToolFormat, functions: list[dict[str, Any]], enforce_all: bool
) -> list[dict[str, Any]]:
    if fmt.array:
        enforced = [
            {**f, "parameters": _args_schema(f, enforce_all or bool(f.get("strict")))}
            for f in functions
        ]
        array = call_schema(fmt, enforced)
        array.pop("maxItems", None)
        return [
            {
                "type": "tag",
                "begin": fmt.begin,
                "content": {"type": "json_schema", "json_schema": array},
                "end": fmt.end,
            }
        ]
    tags = []
    for f in functions:
        schema = _args_schema(f, enforce_all or bool(f.get("strict")))
        content: dict[str, Any] = {}
        if fmt.xml:  # the arguments as XML parameters
            content["style"] = fmt.xml_style
            if fmt.xml_whitespace is not None:
                content["max_whitespace_cnt"] = fmt.xml_whitespace
        if fmt.head is not None:  # the name in the markup, the arguments alone
            head, tail = fmt.head.format(name=f["name"]), ""
        else:
            head, tail = f'{{"name": {json.dumps(f["name"])}, "{fmt.args_key}": ', "}"
        tags.append(
            {
                "type": "tag",
                "begin": fmt.begin + head,
                "content": {"type": "json_schema", "json_schema": schema, **content},
                "end": tail + fmt.end,
            }
        )
    return tags


def _trigger(fmt: ToolFormat) -> str:
    """The text that opens a call: the markup, or the call object's start (Llama 3)."""
    return fmt.begin.strip() or '{"name": '


def _one_call(tags: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    if fmt.array:  # one call: an array of one
        for t in tags:
            t["content"]["json_schema"]["maxItems"] = 1
    return tags


def auto_calls(fmt: ToolFormat, functions: list[dict[str, Any]], parallel: bool) -> str:
    """Free text in which a call, once opened, names a tool and follows a strict tool's
    schema; with ``parallel`` false, generation ends after the first call."""
    tags = _tags(fmt, functions, enforce_all=False)
    if not parallel:
        tags = _one_call(tags, fmt)
    spec = {
        "type": "triggered_tags",
        "triggers": [_trigger(fmt)],
        "tags": tags,
        "at_least_one": False,
        "stop_after_first": not parallel or fmt.array,
    }
    return json.dumps({"type": "structural_tag", "format": spec})


def required_calls(fmt: ToolFormat, functions: list[dict[str, Any]], parallel: bool) -> str:
    """One or more calls (exactly one without ``parallel``) and nothing else, every one's
    arguments valid against its function's schema."""
    tags = _tags(fmt, functions, enforce_all=True)
    if not parallel:
        tags = _one_call(tags, fmt)
    spec = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": fmt.separator,
        "at_least_one": True,
        "stop_after_first": not parallel or fmt.array,
    }
    return json.dumps({"type": "structural_tag", "format": spec})


def forced_calls(fmt: ToolFormat, functions: list[dict[str, Any]], several: bool) -> dict[str, str]:
    """The constraint forcing calls of ``functions`` and nothing else (``several``: one or
    more, else exactly one), as its :class:`~radixserve.sampling_params.SamplingParams`
    field: the format's own grammar where it has no JSON (pythonic calls), a structural tag
    where the markup names the function (XML formats, Mistral's v11, harmony) or several may
    come, else one tagged JSON call object (``tagged_json``)."""
    if fmt.calls_grammar is not None:
        return {"structural_tag": fmt.calls_grammar(functions, several)}
    if fmt.head is not None or several:
        return {"structural_tag": required_calls(fmt, functions, several)}
    return {"tagged_json": forced_call(fmt, functions)}
