"""``POST /v1/messages``: Anthropic's Messages API on the same engine and cache.

The request becomes chat turns (:mod:`.messages_protocol`) and goes through the chat path
shared with the OpenAI APIs (:mod:`.chat_request`). The answer's content blocks:
``thinking`` (what the reasoning parser split out; ``signature`` is empty), ``text``,
``tool_use`` (each parsed call, ``input`` its arguments). ``stop_reason``: ``tool_use``
when there are calls, ``max_tokens`` when the budget ran out, ``stop_sequence`` (with the
one that matched) when a stop sequence ended it, else ``end_turn``. Usage follows
Anthropic's accounting: ``input_tokens`` are the prompt tokens computed,
``cache_read_input_tokens`` those served from the radix cache (their sum is the prompt).
Errors answer in Anthropic's shape (:mod:`.anthropic_errors`); API keys may come as
``x-api-key``.
"""

from __future__ import annotations

import json
from typing import Any

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
from radixserve.serving.http.chat_tools import template_kwargs
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.http.messages_protocol import MessagesRequest
from radixserve.serving.http.messages_reply import Reply, usage
from radixserve.serving.http.messages_stream import events
from radixserve.serving.http.sse import SSEResponse
from radixserve.serving.http.streams import finals, primed

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


async def prepare(body: MessagesRequest, request: Request) -> tuple[Reply, ChatCall]:
    g: Gateway = request.app.state.gateway
    body.check()
    model = await g.check_model(body.model)
    info = await g.info()
    messages = body.chat()
    check_messages(messages, "messages")
    constraint = body.constraint()
    plan = await plan_tools(
        g,
        body.chat_tools(),
        body.chat_tool_choice(),
        constraint is not None,
        body.parallel_tool_calls(),
    )
    stops = list(body.stop_sequences or [])
    params = sampling(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=stops,
        json_schema=constraint,
        thinking_token_budget=body.thinking_budget(),
    )
    call = ChatCall(messages, params, plan, None, template_kwargs(body.template_kwargs()))
    return Reply(model, stops, info.eos_token_ids, g.tokenizer), call


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
