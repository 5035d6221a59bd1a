"""Parsers by name, and the tool-call format a chat template implies.

A template names its format by the markup it writes (``<tool_call>``, Qwen3-Coder's
``<function=``, ``[TOOL_CALLS]`` (with ``[ARGS]``: Mistral's v11 calls), Granite's
``<|tool_call|>``, the pythonic templates' ``[func_name1(`` example, Llama's ``ipython``
role, gpt-oss's harmony ``<|channel|>``); ``--tool-call-parser`` overrides the guess.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from radixserve.agents import (
    glm_xml,
    harmony,
    hermes,
    llama3,
    mistral,
    pythonic,
    pythonic_grammar,
    qwen_xml,
)
from radixserve.agents import reasoning as think
from radixserve.agents.stream import ToolScan


class ToolFormat(NamedTuple):
    """A tool-call format: its parser, and the markup a forced call is wrapped in."""

    name: str
    # (text, final) -> Scan; an XML format's takes the tools' parameter schemas too.
    scan: Callable[..., Any]
    begin: str  # text before the call JSON (XML: before the function's name)
    end: str  # text after it
    args_key: str  # the member holding the arguments
    array: bool  # the calls are a JSON array (Mistral)
    # A format that names the function in its markup, not in a call object (the XML ones,
    # Mistral's v11 calls): the markup after ``begin`` up to the arguments, ``{name}``
    # filled in; its forced calls are structural tags, one per function.
    head: str | None = None
    # Arguments as XML (Qwen's parameters, GLM-4.5's keys and values), not JSON: read back
    # by the tools' schemas, and constrained by xgrammar's ``xml_style`` of a JSON schema.
    xml: bool = False
    xml_style: str = "qwen_xml"
    # The most whitespace a forced call's XML may hold in a row (None: any): GLM-4.5's
    # pairs sit on lines of their own, and a model must not idle in the newlines between.
    xml_whitespace: int | None = None
    # Whether structural tags constrain its calls (forced calls, strict tools and one call
    # under auto): a JSON or XML format's do; pythonic calls have no JSON to tag.
    constrained: bool = True
    # A format without JSON calls: the structural tag forcing calls of some functions,
    # several or one ((functions, several) -> tag; pythonic_grammar.py). Under auto its
    # calls are not constrained (strict tools, one call at most: refused).
    calls_grammar: Callable[[list[dict[str, Any]], bool], str] | None = None
    # What stands between two forced calls (Hermes' blocks: a newline; Llama 3's "; ").
    separator: str = "\n"

    def scanner(self, functions: list[dict[str, Any]]) -> ToolScan:
        """The parser of answers to a request with ``functions`` (OpenAI ``function``s)."""
        if not self.xml:
            return self.scan
        return functools.partial(self.scan, params=qwen_xml.parameter_schemas(functions))


HERMES = ToolFormat(hermes.NAME, hermes.scan, "<tool_call>\n", "\n</tool_call>", "arguments", False)
LLAMA3_JSON = ToolFormat(llama3.NAME, llama3.scan, "", "", "parameters", False, separator="; ")
MISTRAL = ToolFormat(mistral.NAME, mistral.scan, mistral.MARKER + " ", "", "arguments", True)
# Mistral's calls from tokenizer v11 on: one ``[TOOL_CALLS]name[ARGS]{...}`` each, nothing
# between them; the parser is the same (it reads both).
MISTRAL_V11 = ToolFormat(
    mistral.NAME,
    mistral.scan,
    mistral.MARKER,
    "",
    "",
    False,
    head="{name}" + mistral.ARGS,
    separator="",
)
GRANITE = ToolFormat(
    mistral.GRANITE, mistral.granite_scan, mistral.GRANITE_MARKER, "", "arguments", True
)
QWEN3_CODER = ToolFormat(
    qwen_xml.NAME,
    qwen_xml.scan,
    qwen_xml.CALL_BEGIN,
    qwen_xml.CALL_END,
    "",
    False,
    head="{name}>\n",
    xml=True,
)

GLM45 = ToolFormat(
    glm_xml.NAME,
    glm_xml.scan,
    glm_xml.START,
    "\n" + glm_xml.END,
    "",
    False,
    head="{name}\n",
    xml=True,
    xml_style="glm_xml",
    xml_whitespace=1,
)

PYTHONIC = ToolFormat(
    pythonic.NAME,
    pythonic.scan,
    "",
    "",
    "",
    True,
    constrained=False,
    calls_grammar=pythonic_grammar.structural_tag,
)

# gpt-oss's harmony messages: the recipient names the function in the header, the body is
# the arguments' JSON; the parser also reads the reasoning (harmony.THINK), and a forced
# call's header is the one the model writes (the template renders the recipient first).
HARMONY = ToolFormat(
    harmony.NAME,
    harmony.scan,
    harmony.CALL_BEGIN,
    harmony.CALL,
    "",
    False,
    head=harmony.CALL_HEAD,
    separator=harmony.NEXT_MESSAGE,
)

TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": HERMES,
    "qwen": HERMES,
    "qwen25": HERMES,
    "qwen3": HERMES,
    "qwen3_coder": QWEN3_CODER,
    "glm45": GLM45,
    "glm4_moe": GLM45,
    "llama3_json": LLAMA3_JSON,
    "llama3": LLAMA3_JSON,
    "mistral": MISTRAL,
    "granite": GRANITE,
    "pythonic": PYTHONIC,
    "llama4_pythonic": PYTHONIC,
    "gpt-oss": HARMONY,  # SGLang's name
    "openai": HARMONY,  # vLLM's
}
REASONING_FORMATS: dict[str, think.ThinkFormat] = {**think.FORMATS, harmony.NAME: harmony.THINK}


def tool_format(name: str) -> ToolFormat:
    """The format called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r} (known: {', '.join(sorted(TOOL_FORMATS))})"
        ) from None


def served_tool_format(parser: str | None, template: str | None) -> ToolFormat | None:
    """The format of the served model's calls: ``parser`` (``--tool-call-parser``) or the
    template's guess. ``mistral`` is either of Mistral's formats, the one the template writes
    (as vLLM tells them apart by the tokenizer's version)."""
    if not parser:
        return guess_tool_format(template)
    fmt = tool_format(parser)
    if fmt is MISTRAL and template and mistral.ARGS in template:
        return MISTRAL_V11
    return fmt


def implied_reasoning(fmt: ToolFormat | None) -> think.ThinkFormat | None:
    """The reasoning format a tool format implies when the server names none: harmony's
    (the analysis channel has no other reading, and its markup must not reach the content;
    vLLM reads gpt-oss's reasoning so too); ``None`` for the others, whose think blocks
    are the reasoning parser's to name."""
    return harmony.THINK if fmt is HARMONY else None


def keeps_special_tokens(fmt: ToolFormat | None, think_fmt: think.ThinkFormat | None) -> bool:
    """Whether reading answers needs the special tokens kept in the text: harmony's markers
    (``<|channel|>``, ``<|message|>``...) are special tokens of gpt-oss's tokenizer, which
    a detokenizer skipping them would leave as ``analysisThe user...assistantfinal...``."""
    return fmt is HARMONY or (think_fmt is not None and think_fmt.name == harmony.NAME)


def reasoning_format(name: str) -> think.ThinkFormat:
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r} (known: {', '.join(sorted(REASONING_FORMATS))})"
        ) from None


def renders_tools(template: str | None) -> bool:
    """Whether a chat template does anything with a ``tools`` list."""
    return bool(template) and "tools" in (template or "")


def guess_tool_format(template: str | None) -> ToolFormat | None:
    """The format a chat template writes tool calls in, or ``None`` (no tool support)."""
    if not renders_tools(template):
        return None
    assert template is not None
    if harmony.CHANNEL in template and harmony.FUNCTIONS in template:
        return HARMONY  # gpt-oss: <|channel|>commentary to=functions.NAME
    if "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER
    if "<arg_key>" in template:
        return GLM45  # GLM-4.5: <tool_call>name, then <arg_key>/<arg_value> pairs
    if "<tool_call>" in template:
        return HERMES
    if mistral.MARKER in template:
        return MISTRAL_V11 if mistral.ARGS in template else MISTRAL
    if mistral.GRANITE_MARKER in template:
        return GRANITE  # Granite 3.x: the calls' array after <|tool_call|>
    if "[func_name1(" in template or "<|python_start|>" in template:
        return PYTHONIC  # Llama 3.2's pythonic and Llama 4's templates show the list
    if "ipython" in template or "<|python_tag|>" in template:
        return LLAMA3_JSON
    return None
