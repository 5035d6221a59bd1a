"""Anthropic Messages API requests, and their conversion to the engine's chat turns.

``system`` (a string or text blocks), ``messages`` whose content is a string or blocks:
``text``; ``tool_use`` (an assistant's call: ``id``, ``name``, ``input``); ``tool_result``
(a user turn's answer to a call: ``tool_use_id``, ``content``); ``thinking`` (an
assistant's reasoning, handed to the template as ``reasoning_content``). ``tools``
(``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``, ``any``,
``tool`` with a name, ``none``) map onto the chat API's, so the same template rendering,
parsers and forced-call constraint serve both. Anything else (images, documents, server
tools) is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from radixserve.serving.http.chat_tools import FunctionIn, ToolIn
from radixserve.serving.http.errors import invalid
from radixserve.serving.wire import protocol as p

# Fields that would change the output and that radixserve does not implement.
UNSUPPORTED = {
    "mcp_servers": "MCP servers are not supported",
    "container": "containers are not supported",
    "context_management": "context_management is not supported",
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Block(_Strict):
    type: str
    text: str | None = None
    id: str | None = Field(default=None, max_length=256)
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = Field(default=None, max_length=256)
    content: str | list[Block] | None = None
    thinking: str | None = None


class MessageIn(_Strict):
    role: str
    content: str | list[Block]


class ToolDef(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class MessagesConversation(BaseModel):
    """What ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` share: the
    conversation, its tools and its template switches (the fields radixserve reads; others
    are ignored)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=64)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[ToolDef] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # radixserve extension

    def check(self) -> None:
        for name in self.model_extra or {}:
            if name in UNSUPPORTED and (self.model_extra or {})[name] is not None:
                raise invalid(UNSUPPORTED[name], param=name)
        if (self.output_config or {}).get("effort") is not None:
            raise invalid("output_config.effort is not supported", param="output_config")
        self.constraint()

    def constraint(self) -> str | None:
        """``output_config.format`` (``json_schema``) as a JSON schema constraint."""
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise invalid(
                "output_config.format must be a json_schema format", param="output_config"
            )
        if not isinstance(fmt.get("schema"), (dict, bool)):
            raise invalid(
                "output_config.format.schema must be a JSON schema", param="output_config"
            )
        return json.dumps(fmt["schema"])

    def chat_tools(self) -> list[ToolIn] | None:
        if self.tools is None:
            return None
        out = []
        for i, t in enumerate(self.tools):
            if t.type not in (None, "custom"):
                raise invalid(f"tools[{i}]: tool type {t.type!r} is not supported", param="tools")
            fn = FunctionIn(name=t.name, description=t.description, parameters=t.input_schema)
            out.append(ToolIn(type="function", function=fn))
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """``tool_choice`` in the chat API's form."""
        tc = self.tool_choice
        if tc is None:
            return None
        kind = tc.get("type")
        if kind in ("auto", "none"):
            return str(kind)
        if kind == "any":
            return "required"
        if kind == "tool" and isinstance(tc.get("name"), str):
            return {"type": "function", "function": {"name": tc["name"]}}
        raise invalid(
            'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
            '{"type": "tool", "name": ...}',
            param="tool_choice",
        )

    def parallel_tool_calls(self) -> bool | None:
        """Anthropic's ``tool_choice.disable_parallel_tool_use`` as the chat API's
        ``parallel_tool_calls`` (None: the default, several calls allowed)."""
        tc = self.tool_choice or {}
        return False if tc.get("disable_parallel_tool_use") is True else None

    def template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs``, with ``thinking`` as the ``enable_thinking`` switch
        that thinking templates (Qwen3's) read."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            kind = self.thinking.get("type")
            if kind not in ("enabled", "disabled", "adaptive"):
                raise invalid('thinking.type must be "enabled" or "disabled"', param="thinking")
            self.thinking_budget()  # a bad one is a 400 before anything runs
            kwargs.setdefault("enable_thinking", kind != "disabled")
        return kwargs or None

    def thinking_budget(self) -> int | None:
        """``thinking.budget_tokens`` of enabled thinking: the request's
        ``thinking_token_budget`` (the <think> block closed after that many tokens)."""
        if self.thinking is None or self.thinking.get("type") == "disabled":
            return None
        budget = self.thinking.get("budget_tokens")
        if budget is not None and (type(budget) is not int or budget < 1):
            raise invalid(
                f"thinking.budget_tokens must be a positive integer, got {budget!r}",
                param="thinking.budget_tokens",
            )
        return budget

    def chat(self) -> list[p.ChatMessage]:
        """The conversation as chat turns (``system`` first)."""
        out: list[p.ChatMessage] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else _texts(system, "system")
            out.append(p.ChatMessage(role="system", content=text))
        names: dict[str, str] = {}
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if m.role not in ("user", "assistant"):
                raise invalid(f"{where}.role must be user or assistant", param=where)
            if isinstance(m.content, str):
                out.append(p.ChatMessage(role=m.role, content=m.content))
            elif m.role == "assistant":
                out.append(_assistant(m.content, where, names))
            else:
                out.extend(_user(m.content, where, names))
        return out


class MessagesRequest(MessagesConversation):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)


class CountTokensRequest(MessagesConversation):
    """``POST /v1/messages/count_tokens``: the conversation a Messages request would send."""


def _texts(blocks: list[Block], where: str) -> str:
    texts = []
    for j, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise invalid(
                f"{where}[{j}]: only text blocks are supported here (got {b.type!r})", param=where
            )
        texts.append(b.text)
    return "\n".join(texts)


def _assistant(blocks: list[Block], where: str, names: dict[str, str]) -> p.ChatMessage:
    texts, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        if b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "thinking" and b.thinking is not None:
            reasoning.append(b.thinking)
        elif b.type == "redacted_thinking":
            continue  # opaque to any model but the one that wrote it
        elif b.type == "tool_use" and b.id and b.name and b.input is not None:
            names[b.id] = b.name
            calls.append(p.ToolCallPart(id=b.id, name=b.name, arguments=json.dumps(b.input)))
        else:
            raise invalid(
                f"{where}.content[{j}]: a malformed or unsupported {b.type!r} block", param=where
            )
    return p.ChatMessage(
        role="assistant",
        content="".join(texts),
        tool_calls=calls or None,
        reasoning_content="".join(reasoning) or None,
    )


def _user(blocks: list[Block], where: str, names: dict[str, str]) -> list[p.ChatMessage]:
    """Tool results (each a ``tool`` turn, in order), then the text (one user turn)."""
    out, texts = [], []
    for j, b in enumerate(blocks):
        if b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "tool_result" and b.tool_use_id:
            c = b.content
            content = c if isinstance(c, str) else _texts(c or [], f"{where}.content[{j}].content")
            tid = b.tool_use_id
            out.append(
                p.ChatMessage(role="tool", content=content, tool_call_id=tid, name=names.get(tid))
            )
        else:
            raise invalid(
                f"{where}.content[{j}]: a malformed or unsupported {b.type!r} block", param=where
            )
    if texts or not out:
        out.append(p.ChatMessage(role="user", content="\n".join(texts)))
    return out
