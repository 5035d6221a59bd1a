"""``POST /v1/responses``: OpenAI's Responses API on the same engine and cache.

The request's items (after the conversation stored under ``previous_response_id``, if
any) become chat turns (:mod:`.responses_items`) and go through the chat path shared with
``/v1/chat/completions`` (:mod:`.chat_request`): the model's template renders them and
the tools, the template's parser reads calls back as ``function_call`` items, the
reasoning parser's thinking becomes a ``reasoning`` item. Streams follow OpenAI's event
sequence (:mod:`.responses_stream`).

``background: true`` answers at once and runs the turn in the gateway
(:mod:`.responses_background`; ``POST /v1/responses/{id}/cancel`` stops it); with
``stream: true`` its events stream, and ``GET /v1/responses/{id}?stream=true`` picks them
up again after a dropped connection.
``previous_response_id`` continues a stored conversation (:mod:`.responses_store`, per
tenant, bounded) and is the router's session key for the whole chain (the first
response's id; ``prompt_cache_key`` overrides it), so every turn of one conversation
meets its cached prefix on the same worker. ``GET /v1/responses/{id}`` gives a stored
response back as it was answered; ``DELETE`` forgets it (the tenant's own, either way).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator
from functools import partial
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from radixserve.serving.http import responses_items as items_
from radixserve.serving.http.auth import request_key
from radixserve.serving.http.chat_request import (
    ChatCall,
    check_messages,
    open_stream,
    plan_tools,
    read_answer,
    sampling,
)
from radixserve.serving.http.chat_tools import template_kwargs, with_reasoning_effort
from radixserve.serving.http.errors import APIError, invalid
from radixserve.serving.http.gateway import Gateway, final_of
from radixserve.serving.http.openai_protocol import retention_seconds
from radixserve.serving.http.responses_background import BackgroundRuns, EventLog
from radixserve.serving.http.responses_store import ResponseStore, tenant_of
from radixserve.serving.http.responses_stream import events
from radixserve.serving.http.sse import SSEResponse
from radixserve.serving.http.streams import finals, primed
from radixserve.serving.wire import protocol as p

router = APIRouter()
log = logging.getLogger("radixserve.serving.http")

# Fields of OpenAI's Responses requests that would change the output and are not
# implemented: a 400 naming the field. Other unknown fields are ignored, as OpenAI does.
UNSUPPORTED = {
    "conversation": "the Conversations API is not supported; use previous_response_id",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "max_tool_calls": "max_tool_calls is not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
    "context_management": "context_management is not supported",
}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ResponsesRequest(_Body):
    """``POST /v1/responses`` (the fields radixserve reads)."""

    model: str
    input: str | list[Any] = []
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=256)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    # Answered at once, run by the gateway, polled with GET or streamed (responses_background.py).
    background: bool = False
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    # The chat API's cache controls: OpenAI's prompt_cache_retention ("in_memory", or a time
    # such as "24h": the prompt prefix pinned that long, within the pin budget) and priority.
    prompt_cache_retention: str | None = Field(default=None, max_length=16)
    priority: int = Field(default=0, ge=-1000, le=1000)
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # radixserve / vLLM extension
    # As on chat completions: the <think> block closed after this many tokens (vLLM's name).
    thinking_token_budget: int | None = None
    # What the output carries beyond the defaults: "reasoning.encrypted_content" (reasoning
    # items a stateless client sends back: responses_items.SEALED); the others name tools
    # this server does not run, but for output logprobs (a 400, as top_logprobs).
    include: list[str] | None = Field(default=None, max_length=16)

    def check(self) -> None:
        for name in self.model_extra or {}:
            if name in UNSUPPORTED and (self.model_extra or {})[name] not in (None, False):
                raise invalid(UNSUPPORTED[name], param=name)
        if self.truncation not in (None, "disabled"):
            raise invalid('only truncation "disabled" is supported', param="truncation")
        if not self.input and self.previous_response_id is None:
            raise invalid("input must not be empty", param="input")
        if self.background and not self.store:
            raise invalid("a background response is stored: send store true", param="store")
        self.pin_ttl_s()  # a bad prompt_cache_retention fails before anything runs
        if "message.output_text.logprobs" in (self.include or ()):
            raise invalid(UNSUPPORTED["top_logprobs"], param="include")

    @property
    def seals_reasoning(self) -> bool:
        """Whether reasoning items carry their ``encrypted_content`` (``include``)."""
        return "reasoning.encrypted_content" in (self.include or ())

    @property
    def effort(self) -> Any:
        """``reasoning.effort`` (None when not given)."""
        return (self.reasoning or {}).get("effort")

    def pin_ttl_s(self) -> float | None:
        """``prompt_cache_retention`` as the prompt prefix's pin (None: no pin)."""
        retention = self.prompt_cache_retention
        return None if retention is None else retention_seconds(retention)

    def constraint(self) -> str | None:
        """``text.format`` as a JSON schema constraint (``json_schema`` / ``json_object``)."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return json.dumps({"type": "object"})
        if kind == "json_schema" and isinstance(fmt.get("schema"), (dict, bool)):
            return json.dumps(fmt["schema"])
        raise invalid(
            "text.format must be text, json_object or json_schema with a schema", param="text"
        )


def store_of(request: Request) -> ResponseStore:
    """The app's response store (made on first use)."""
    state = request.app.state
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore()
    return state.responses


class Turn:
    """One Responses request being answered: what the stream and the final body need."""

    def __init__(self, body: ResponsesRequest, model: str, history: list[dict[str, Any]]) -> None:
        self.body = body
        self.model = model
        self.history = history  # stored items before + this request's input items
        self.id = items_.new_id("resp")
        self.created = int(time.time())
        self.session = ""

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        final: p.GenerateFinal | None = None,
    ) -> dict[str, Any]:
        """The Response object (``status`` in_progress / completed / incomplete / failed)."""
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.effort, "summary": None},
            "store": b.store,
            "background": b.background,
            "temperature": b.temperature,
            "text": b.text or {"format": {"type": "text"}},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [],
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": usage(final) if final is not None else None,
            "user": b.user,
            "metadata": b.metadata or {},
            "prompt_cache_key": b.prompt_cache_key,
        }


def usage(final: p.GenerateFinal) -> dict[str, Any]:
    """Responses usage: ``input_tokens_details.cached_tokens`` = prompt tokens served from
    the radix cache (cache writes and reasoning tokens are not counted separately: 0)."""
    u = final.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


async def prepare(body: ResponsesRequest, request: Request) -> tuple[Turn, ChatCall]:
    """Check the request and turn it into the chat call (400s before any work)."""
    g: Gateway = request.app.state.gateway
    body.check()
    model, lora = await g.resolve_model(body.model)
    info = await g.info()
    new_items = items_.with_ids(items_.parse_items(body.input))
    tenant = tenant_of(request_key(request.scope))
    history, session = [], None
    if body.previous_response_id is not None:
        stored = store_of(request).get(tenant, body.previous_response_id)
        if stored is None:
            raise APIError(
                400,
                f"Previous response with id {body.previous_response_id!r} not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        if stored.response is not None and stored.response["status"] == "in_progress":
            raise invalid(
                f"Response {body.previous_response_id!r} is still in progress: continue from "
                "it once it has ended",
                param="previous_response_id",
            )
        history, session = list(stored.items), stored.session
    turn = Turn(body, model, history + new_items)
    messages = items_.to_messages(turn.history, body.instructions)
    check_messages(messages, "input")
    constraint = body.constraint()
    tools, choice = items_.chat_tools_of(body.tools), items_.chat_tool_choice(body.tool_choice)
    # text.format shapes a message; a forced turn writes a call instead, so it drops the format.
    forcing = choice == "required" or isinstance(choice, dict)
    if forcing:
        constraint = None
    plan = await plan_tools(g, tools, choice, constraint is not None, body.parallel_tool_calls)
    # The chain's session key: the client's, else the first stored response's id (a
    # response nobody can continue gets none).
    turn.session = body.prompt_cache_key or session or (turn.id if body.store else "")
    params = sampling(
        max_tokens=body.max_output_tokens or max(1, info.context_length),
        temperature=body.temperature,
        top_p=body.top_p,
        json_schema=constraint,
        pin_ttl_s=body.pin_ttl_s(),
        thinking_token_budget=body.thinking_token_budget,
    )
    kwargs = template_kwargs(
        with_reasoning_effort(
            body.chat_template_kwargs, body.effort, info.chat_template, "reasoning.effort"
        )
    )
    call = ChatCall(
        messages, params, plan, turn.session or None, kwargs, priority=body.priority, lora=lora
    )
    return turn, call


def remember(request: Request, turn: Turn, response: dict[str, Any]) -> None:
    """Store the conversation through this finished response, and the response itself
    (unless ``store: false``)."""
    if turn.body.store:
        tenant = tenant_of(request_key(request.scope))
        items = turn.history + response["output"]
        store_of(request).put(tenant, turn.id, items, turn.session, response)


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    g: Gateway = request.app.state.gateway
    turn, call = await prepare(body, request)
    if body.background:
        response, log = start_background(request, turn, call)
        return JSONResponse(response) if log is None else SSEResponse(log.follow())
    stream = open_stream(g, request, call)
    if body.stream:
        first = await primed(request, stream)
        return SSEResponse(events(turn, call.plan, first, partial(remember, request, turn)))
    (final,) = await finals(request, [stream])
    response = answered(turn, call, final)
    remember(request, turn, response)
    return JSONResponse(response)


def answered(turn: Turn, call: ChatCall, final: p.GenerateFinal) -> dict[str, Any]:
    """The Response of a turn that ran to its end: its output items read from the answer."""
    answer = read_answer(call.plan, final.text, final.finish_reason)
    incomplete = final.finish_reason == "length"
    output = items_.output_items(
        answer.content, answer.reasoning, answer.calls, incomplete, turn.body.seals_reasoning
    )
    return turn.response("incomplete" if incomplete else "completed", output, final)


def start_background(
    request: Request, turn: Turn, call: ChatCall
) -> tuple[dict[str, Any], EventLog | None]:
    """Store ``turn`` in progress and run it in the gateway's background; the response as
    it is now, and the log of its events when it is streamed (responses_background.py)."""
    key = (tenant_of(request_key(request.scope)), turn.id)
    response = turn.response("in_progress", [])
    runs = background_of(request)
    event_log = runs.new_log(key) if turn.body.stream else None
    runs.start(key, _run(request, turn, call, event_log))
    store_of(request).put(key[0], turn.id, turn.history, turn.session, response)
    return response, event_log


async def _run(request: Request, turn: Turn, call: ChatCall, event_log: EventLog | None) -> None:
    """A background turn to its end, its stored response following: completed (or
    incomplete), failed with the error, or cancelled; its events into ``event_log`` when it is
    streamed."""
    g: Gateway = request.app.state.gateway
    try:
        stream = open_stream(g, request, call)
        if event_log is None:
            response = answered(turn, call, await final_of(stream))
        else:
            response = await _logged(turn, call, stream, event_log)
    except asyncio.CancelledError:  # cancel_response, a delete, or the gateway closing
        response = turn.response("cancelled", [])
    except APIError as exc:
        response = _failed(turn, exc.code or exc.type, exc.message)
    except Exception as exc:  # a bug must still end the response, not leave it in progress
        log.exception("background response %s failed", turn.id)
        response = _failed(turn, "server_error", f"{type(exc).__name__}: {exc}")
    remember(request, turn, response)
    if event_log is not None:
        event_log.end()


async def _logged(
    turn: Turn, call: ChatCall, stream: AsyncGenerator[Any, None], event_log: EventLog
) -> dict[str, Any]:
    """A streamed background turn's events into ``event_log`` (the stream closed on the way out,
    so a cancel aborts the request); its final response."""
    ended: list[dict[str, Any]] = []
    async with contextlib.aclosing(stream) as router_events:
        turn_events = events(turn, call.plan, router_events, ended.append, ended.append)
        async with contextlib.aclosing(turn_events) as sse:
            async for event in sse:
                event_log.append(event)
    return ended[-1]


def _failed(turn: Turn, code: str, message: str) -> dict[str, Any]:
    response = turn.response("failed", [])
    response["error"] = {"code": code, "message": message}
    return response


def background_of(request: Request) -> BackgroundRuns:
    """The app's background runs (made on first use; the gateway stops them on shutdown)."""
    state = request.app.state
    if getattr(state, "background", None) is None:
        state.background = BackgroundRuns()
        state.gateway.on_close(state.background.close)
    return state.background


def _not_found(response_id: str) -> APIError:
    return APIError(
        404, f"Response with id {response_id!r} not found.", param="response_id", code="not_found"
    )


@router.get("/v1/responses/{response_id}", response_model=None)
async def get_response(
    response_id: str,
    request: Request,
    stream: bool = False,
    starting_after: int | None = Query(default=None, ge=0),
) -> Response:
    """A stored response, as it was answered (the tenant's own only); with ``stream``, a
    streamed background response's events after ``starting_after``, then the rest as they
    come (responses_background.py)."""
    key = (tenant_of(request_key(request.scope)), response_id)
    stored = store_of(request).get(*key)
    if stored is None or stored.response is None:
        raise _not_found(response_id)
    if not stream:
        return JSONResponse(stored.response)
    log = background_of(request).log(key)
    if log is None:
        raise invalid(
            f"Response {response_id!r} was not streamed in the background, or its events "
            "are no longer kept: GET it without stream",
            param="stream",
        )
    return SSEResponse(log.follow(-1 if starting_after is None else starting_after))


@router.get("/v1/responses/{response_id}/input_items", response_model=None)
async def list_input_items(
    response_id: str,
    request: Request,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
) -> Response:
    """The input items of a stored response (the tenant's own only): every item the model
    was given, the earlier turns' of a chain included, as the store keeps them."""
    stored = store_of(request).get(tenant_of(request_key(request.scope)), response_id)
    if stored is None or stored.response is None:
        raise _not_found(response_id)
    given = stored.items[: len(stored.items) - len(stored.response["output"])]
    return JSONResponse(items_.input_page(given, after, limit, order))


@router.post("/v1/responses/{response_id}/cancel", response_model=None)
async def cancel_response(response_id: str, request: Request) -> Response:
    """Stop a background response (the tenant's own): it ends ``cancelled``, its request
    aborted in the worker. One that has ended already is answered as it is."""
    tenant = tenant_of(request_key(request.scope))
    stored = store_of(request).get(tenant, response_id)
    if stored is None or stored.response is None:
        raise _not_found(response_id)
    if not stored.response.get("background"):
        raise invalid("Only a background response can be cancelled.", param="response_id")
    await background_of(request).cancel((tenant, response_id))
    stored = store_of(request).get(tenant, response_id)
    return JSONResponse(stored.response if stored is not None else {})


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, request: Request) -> Response:
    """Forget a stored response (a background one still running is stopped first): it can
    be neither retrieved nor continued any more."""
    tenant = tenant_of(request_key(request.scope))
    runs = background_of(request)
    await runs.cancel((tenant, response_id))
    runs.forget((tenant, response_id))
    if not store_of(request).delete(tenant, response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
