"""The chat request behind every chat-shaped API: messages, sampling, a tool plan -> one stream.

``/v1/chat/completions``, ``/v1/responses`` and ``/v1/messages`` differ only in their
shapes. Each converts its body into :class:`~radixserve.serving.wire.protocol.ChatMessage`
turns, a :class:`~radixserve.sampling_params.SamplingParams` and the chat tool fields
(``tools``, ``tool_choice`` in the chat API's form), then shares the rest from here and
from :mod:`.chat_tools`: the tool plan (checked against the model's template and the
server's parsers), the forced-call constraint, the router request (rendered by the
model's own template in the router, so the three APIs give one conversation the same
prompt tokens and so the same cached prefix), and the reading of the answer into
content, reasoning and calls.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any, NamedTuple

from fastapi import Request

from radixserve.agents.types import ToolCall
from radixserve.sampling_params import SamplingParams
from radixserve.serving.http import chat_tools
from radixserve.serving.http.auth import request_key, tenant_cache_salt
from radixserve.serving.http.chat_tools import ToolIn, ToolPlan
from radixserve.serving.http.errors import invalid
from radixserve.serving.http.gateway import Event, Gateway
from radixserve.serving.wire import protocol as p


class ChatCall(NamedTuple):
    """One chat generation, in the engine's terms."""

    messages: list[p.ChatMessage]
    params: SamplingParams
    plan: ToolPlan
    session: str | None = None
    template_kwargs: str | None = None
    cache_salt: str | None = None  # the client's; the tenant's key is folded in by open_stream
    priority: int = 0  # cache priority (--eviction-policy priority), as the chat API's field
    # The last message is the start of the reply, left open for the model to go on with
    # (Anthropic's prefill): rendered without a generation prompt.
    continue_final: bool = False
    lora: str | None = None  # the served LoRA adapter its model names (Gateway.resolve_model)


class Answer(NamedTuple):
    """A finished answer read by the plan's parsers."""

    content: str
    reasoning: str
    calls: list[ToolCall]
    finish_reason: str


def sampling(**fields: Any) -> SamplingParams:
    """:class:`SamplingParams` of the given fields (``None`` values left at their defaults),
    validated: a bad value is a 400."""
    kw = {k: v for k, v in fields.items() if v is not None}
    try:
        return SamplingParams(**kw).validate()
    except ValueError as exc:
        raise invalid(str(exc)) from exc


async def plan_tools(
    g: Gateway,
    tools: list[ToolIn] | None,
    tool_choice: str | dict[str, Any] | None,
    has_constraint: bool = False,
    parallel_tool_calls: bool | None = None,
    template: str | None = None,
) -> ToolPlan:
    """:func:`chat_tools.plan` against the served model's template (or the request's own,
    ``template``) and the server's parsers."""
    info = await g.info()
    return chat_tools.plan(
        tools,
        tool_choice,
        template or info.chat_template,
        g.config.tool_call_parser,
        g.config.reasoning_parser,
        has_constraint,
        parallel_tool_calls,
    )


def open_stream(g: Gateway, request: Request, call: ChatCall) -> AsyncGenerator[Event, None]:
    """The router stream of ``call`` (the plan's tool constraint applied, as chat completions
    apply it: forced calls, several required calls, strict tools under auto; the tenant's
    cache salt derived from the request's API key)."""
    return g.stream(
        arrival=time.monotonic(),
        messages=call.messages,
        params=chat_tools.constrain(call.params, call.plan),
        cache_salt=tenant_cache_salt(request_key(request.scope), call.cache_salt),
        session_id=call.session,
        priority=call.priority,
        tools=call.plan.tools_json,
        chat_template_kwargs=call.template_kwargs,
        add_generation_prompt=not call.continue_final,
        continue_final_message=call.continue_final,
        lora=call.lora,
    )


def read_answer(plan: ToolPlan, text: str, finish_reason: str) -> Answer:
    """The whole answer split into content, reasoning and calls (malformed calls stay
    content, as in the chat API)."""
    parser = chat_tools.output_parser(plan)
    if parser is None:
        return Answer(text, "", [], finish_reason)
    parser.parse(text)
    return Answer(parser.content, parser.reasoning, list(parser.calls), finish_reason)


def check_messages(messages: list[p.ChatMessage], param: str) -> None:
    """At most :data:`chat_tools.MAX_MESSAGES` turns (a long agent history is hundreds)."""
    if len(messages) > chat_tools.MAX_MESSAGES:
        raise invalid(
            f"the conversation has {len(messages)} turns, more than {chat_tools.MAX_MESSAGES}",
            param=param,
        )
