"""``POST /v1/messages``: Anthropic's Messages API on the same engine and cache.

The request becomes chat turns (:mod:`.messages_protocol`) and goes through the chat path
shared with the OpenAI APIs (:mod:`.chat_request`). The answer's content blocks:
``thinking`` (what the reasoning parser split out; ``signature`` is empty), ``text``,
``tool_use`` (each parsed call, ``input`` its arguments). ``stop_reason``: ``tool_use``
when there are calls, ``max_tokens`` when the budget ran out, ``stop_sequence`` (with the
one that matched) when a stop sequence ended it, else ``end_turn``. Usage follows
Anthropic's accounting: ``input_tokens`` are the prompt tokens computed,
``cache_read_input_tokens`` those served from the radix cache (their sum is the prompt).
A final assistant message is a prefill: the reply's start, rendered open for the model to
go on with; the answer holds what it adds. Errors answer in Anthropic's shape
(:mod:`.anthropic_errors`); API keys may come as ``x-api-key``.
``POST /v1/messages/count_tokens`` answers ``{"input_tokens": N}``: the prompt the same
body would send, rendered and encoded as the request's own.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixserve.serving.http.chat_request import (
    Answer,
    ChatCall,
    check_messages,
    open_stream,
    plan_tools,
    read_answer,
    sampling,
)
from radixserve.serving.http.chat_tools import ToolPlan, after_prefill, template_kwargs
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.http.messages_protocol import (
    CountTokensRequest,
    MessagesConversation,
    MessagesRequest,
)
from radixserve.serving.http.messages_reply import Reply, usage
from radixserve.serving.http.messages_stream import events
from radixserve.serving.http.sse import SSEResponse
from radixserve.serving.http.streams import finals, primed
from radixserve.serving.wire import protocol as p

router = APIRouter()


def blocks(answer: Answer) -> list[dict[str, Any]]:
    """The content blocks of a finished answer."""
    out: list[dict[str, Any]] = []
    if answer.reasoning:
        out.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content:
        out.append({"type": "text", "text": answer.content})
    for c in answer.calls:
        out.append({"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)})
    return out


def _input(arguments: str) -> dict[str, Any]:
    # The parsers hand back only calls whose arguments are a JSON object; guarded anyway,
    # since a 500 here would lose the whole answer.
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class Conversation(NamedTuple):
    """A Messages body as the chat path takes it: its model's name, turns, tool plan and
    template variables (JSON text)."""

    model: str
    messages: list[p.ChatMessage]
    plan: ToolPlan
    template_kwargs: str | None
    continue_final: bool  # the last message is a prefilled reply for the model to go on with
    lora: str | None  # the served LoRA adapter its model names


async def conversation(g: Gateway, body: MessagesConversation) -> Conversation:
    """``body`` checked and converted (a bad field is a 400 before anything runs)."""
    body.check()
    model, lora = await g.resolve_model(body.model)
    messages, prefilled = prefill(body.chat())
    check_messages(messages, "messages")
    plan = await plan_tools(
        g,
        body.chat_tools(),
        body.chat_tool_choice(),
        body.constraint() is not None,
        body.parallel_tool_calls(),
    )
    if prefilled:
        plan = after_prefill(plan, messages[-1].content)
    kwargs = template_kwargs(body.template_kwargs())
    return Conversation(model, messages, plan, kwargs, prefilled, lora)


def prefill(messages: list[p.ChatMessage]) -> tuple[list[p.ChatMessage], bool]:
    """Anthropic's prefill: a final assistant message is the start of the reply, which the
    model goes on with (the answer holds only what it adds); an empty one is the same as
    none."""
    last = messages[-1]
    if last.role != "assistant" or last.tool_calls:
        return messages, False
    if not last.content:
        return messages[:-1], False
    return messages, True


async def prepare(body: MessagesRequest, request: Request) -> tuple[Reply, ChatCall]:
    g: Gateway = request.app.state.gateway
    model, messages, plan, kwargs, prefilled, lora = await conversation(g, body)
    stops = list(body.stop_sequences or [])
    params = sampling(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=stops,
        json_schema=body.constraint(),
        thinking_token_budget=body.thinking_budget(),
    )
    call = ChatCall(messages, params, plan, None, kwargs, continue_final=prefilled, lora=lora)
    return Reply(model), call


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    g: Gateway = request.app.state.gateway
    reply, call = await prepare(body, request)
    stream = open_stream(g, request, call)
    if body.stream:
        return SSEResponse(events(reply, call.plan, await primed(request, stream)))
    (final,) = await finals(request, [stream])
    answer = read_answer(call.plan, final.text, final.finish_reason)
    reason, seq = reply.stop_reason(final, bool(answer.calls))
    msg = reply.head()
    msg.update(content=blocks(answer), stop_reason=reason, stop_sequence=seq, usage=usage(final))
    return JSONResponse(msg)


@router.post("/v1/messages/count_tokens", response_model=None)
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The prompt tokens the same body would send to ``/v1/messages``: its system prompt,
    turns and tools rendered by the model's template and encoded by the router, as a
    Messages request's are (Claude Code asks before it sends a long context)."""
    g: Gateway = request.app.state.gateway
    _, messages, plan, kwargs, prefilled, _ = await conversation(g, body)
    ids = await g.tokenize_chat(
        messages,
        tools=plan.tools_json,
        chat_template_kwargs=kwargs,
        add_generation_prompt=not prefilled,
        continue_final_message=prefilled,
    )
    return JSONResponse({"input_tokens": len(ids)})
