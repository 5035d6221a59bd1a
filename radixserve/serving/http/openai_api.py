"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

``n`` choices are ``n`` router requests of the same prompt (the radix cache shares the
prompt's KV between them). Usage counts each prompt once (its first choice's numbers),
with ``prompt_tokens_details.cached_tokens`` = prompt tokens served from the radix cache.
Streams follow OpenAI's chunk format: a role delta first, content deltas, one chunk with
the ``finish_reason`` per choice, an optional usage chunk
(``stream_options.include_usage``), then ``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixserve.serving.http import beam_search, chat_tools
from radixserve.serving.http.aborts import abort_scope
from radixserve.serving.http.auth import request_key, tenant_cache_salt
from radixserve.serving.http.errors import APIError, invalid
from radixserve.serving.http.gateway import Gateway, merge
from radixserve.serving.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixserve.serving.http.openai_reply import (
    ChatHead,
    ChatStream,
    chat_logprobs,
    completion_logprobs,
    last_hidden_state,
    prompt_logprobs_part,
    usage,
    vllm_prompt_logprobs,
)
from radixserve.serving.http.sse import DONE, SSEResponse, event
from radixserve.serving.http.streams import finals, primed, stop_reason
from radixserve.serving.wire import protocol as p

router = APIRouter()


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway


# ---------------------------------------------------------------------------- models


def _model_card(
    g: Gateway, name: str, context_length: int | None, parent: str | None = None
) -> dict[str, Any]:
    """The served model in OpenAI's shape and Anthropic's Models API shape at once (each SDK
    reads its own fields: ``models.list`` and ``models.retrieve`` work from both). A LoRA
    adapter's card names the model it adapts as ``parent`` (vLLM's field)."""
    return {
        "id": name,
        "object": "model",
        "created": int(g.started),
        "owned_by": "radixserve",
        "root": name,
        "parent": parent,
        "max_model_len": context_length,
        "type": "model",  # Anthropic's
        "display_name": name,
        "created_at": datetime.fromtimestamp(int(g.started), UTC)
        .isoformat()
        .replace("+00:00", "Z"),
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    g = _gw(request)
    name, info = await g.model_name(), await g.info()
    cards = [_model_card(g, name, info.context_length)] + [
        _model_card(g, adapter, info.context_length, parent=name)
        for adapter in await g.refresh_adapters()
    ]
    # "object"/"data" are OpenAI's list; "has_more"/"first_id"/"last_id" Anthropic's page.
    return {
        "object": "list",
        "data": cards,
        "has_more": False,
        "first_id": cards[0]["id"],
        "last_id": cards[-1]["id"],
    }


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    g = _gw(request)
    name, adapter = await g.resolve_model(model_id)
    served = await g.model_name()
    parent = None if adapter is None else served
    return _model_card(g, name, (await g.info()).context_length, parent)


# ---------------------------------------------------------------------------- chat


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    g = _gw(request)
    body.check()
    model, lora = await g.model_and_adapter(body.model, body.lora_path)
    info = await g.info()
    g.check_batch(body.n)
    g.check_chat_template(body.chat_template)
    template = body.chat_template or info.chat_template
    max_tokens, want_lp = body.wanted_max_tokens(info.context_length), body.wanted_logprobs()
    tools = chat_tools.plan(
        body.tools,
        body.tool_choice,
        template,
        g.config.tool_call_parser,
        g.config.reasoning_parser,
        bool(body.constraint()),
        body.parallel_tool_calls,
    )
    kwargs = chat_tools.template_kwargs(
        chat_tools.with_reasoning_effort(
            body.chat_template_kwargs, body.reasoning_effort, template, "reasoning_effort"
        )
    )
    messages = body.chat()
    if body.continue_final_message:
        tools = chat_tools.after_prefill(tools, messages[-1].content)
    key = request_key(request.scope)
    salt = tenant_cache_salt(key, body.cache_salt)
    rid, created = body.rid or f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    if body.use_beam_search:
        ids = await g.tokenize_chat(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=tools.tools_json,
            chat_template_kwargs=kwargs,
            chat_template=body.chat_template,
        )
        limit = body.max_completion_tokens or body.max_tokens  # else: what the context leaves
        (found,) = await beam_search.search(g, body, [ids], limit, salt, lora)
        return JSONResponse(beam_search.chat_reply(found, rid, model, tools, body.return_token_ids))

    def params(i: int) -> Any:
        return chat_tools.constrain(body.sampling(max_tokens, want_lp, i), tools)

    streams = [
        g.stream(
            arrival=arrival,
            messages=messages,
            params=params(i),
            cache_salt=salt,
            priority=body.priority,
            session_id=body.session,
            tools=tools.tools_json,
            chat_template_kwargs=kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            prediction=None if body.prediction is None else body.prediction.text(),
            lora=lora,
            chat_template=body.chat_template,
            abort_scope=abort_scope(key, rid),
        )
        for i in range(body.n)
    ]
    head = ChatHead(
        rid,
        created,
        model,
        want_lp is not None,
        body.stop_token_ids,
        body.prompt_logprobs,
        body.return_token_ids,
        body.return_tokens_as_token_ids,
        body.return_hidden_states,
    )
    if body.stream:
        events = await primed(request, merge(streams))
        return SSEResponse(ChatStream(g, head, body.chunk_usage(), tools).chunks(events))
    results = await finals(request, streams)
    return JSONResponse(_chat_completion(g, head, results, tools))


def _chat_completion(
    g: Gateway, head: ChatHead, results: list[p.GenerateFinal], tools: chat_tools.ToolPlan
) -> dict[str, Any]:
    """The answer that is not streamed: a choice per result (content, reasoning and calls
    read by the tool plan), usage over them all."""
    choices = []
    for i, f in enumerate(results):
        msg, finish_reason = chat_tools.message(tools, f.text, f.finish_reason)
        as_ids = head.tokens_as_ids
        logprobs = {"content": chat_logprobs(g, f.logprobs, as_ids)} if head.want_logprobs else None
        choices.append(
            {
                "index": i,
                "message": msg,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason(f, head.stop_token_ids),
            }
        )
        if head.hidden_states:
            choices[-1]["hidden_states"] = last_hidden_state(f)
    out = {
        "id": head.rid,
        "object": "chat.completion",
        "created": head.created,
        "model": head.model,
        "choices": choices,
        "usage": usage([results], g),
        "system_fingerprint": None,
    }
    if head.prompt_logprobs is not None:  # vLLM's: the prompt is every choice's
        out["prompt_logprobs"] = vllm_prompt_logprobs(g, results[0], head.prompt_logprobs)
    if head.token_ids:  # vLLM's return_token_ids
        out["prompt_token_ids"] = results[0].prompt_token_ids
        for choice, f in zip(choices, results):
            choice["token_ids"] = f.token_ids
    return out


# ---------------------------------------------------------------------------- completions


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    g = _gw(request)
    body.check()
    model, lora = await g.model_and_adapter(body.model, body.lora_path)
    await g.info()  # the tokenizer echoes read
    prompts = body.prompts()
    g.check_batch(len(prompts) * body.n)
    echoes = [_echo_text(g, pr) if body.echo else "" for pr in prompts]
    max_tokens = body.max_tokens if body.max_tokens is not None else (await g.info()).context_length
    max_tokens = max(max_tokens, 1)  # max_tokens 0 (echo only): one token, dropped below
    key = request_key(request.scope)
    salt = tenant_cache_salt(key, body.cache_salt)
    rid, created = body.rid or f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if body.use_beam_search:
        searched = await beam_search.search(g, body, prompts, max_tokens, salt, lora)
        return JSONResponse(beam_search.reply(searched, rid, model, body.return_token_ids))
    streams = []
    for pr in prompts:
        kw: dict[str, Any] = {"text": pr} if isinstance(pr, str) else {"input_ids": pr}
        for j in range(body.n):
            streams.append(
                g.stream(
                    arrival=arrival,
                    params=body.sampling(
                        max_tokens, body.logprobs, j, 0 if body.scores_prompt else None
                    ),
                    cache_salt=salt,
                    priority=body.priority,
                    session_id=body.session,
                    lora=lora,
                    abort_scope=abort_scope(key, rid),
                    **kw,
                )
            )
    if body.stream:
        events = await primed(request, merge(streams))
        return SSEResponse(_completion_events(g, events, rid, created, model, body, echoes))
    results = await finals(request, streams)
    if body.prompt_only:
        results = [_without_completion(f) for f in results]
    choices = [
        _completion_choice(g, body, echoes[i // body.n], i, f) for i, f in enumerate(results)
    ]
    groups = [results[k : k + body.n] for k in range(0, len(results), body.n)]
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(groups, g),
            "system_fingerprint": None,
        }
    )


def _completion_choice(
    g: Gateway, body: CompletionRequest, echo: str, i: int, f: p.GenerateFinal
) -> dict[str, Any]:
    """Choice ``i`` of an answer that is not streamed (its logprobs the prompt's first, when
    echo asks for them)."""
    logprobs = None
    if body.logprobs is not None:
        as_ids = body.return_tokens_as_token_ids
        logprobs = completion_logprobs(g, f.logprobs, len(echo), as_ids)
        if body.scores_prompt:
            prompt = prompt_logprobs_part(g, f, body.logprobs, as_ids)
            logprobs = {name: prompt[name] + values for name, values in logprobs.items()}
    choice = {
        "index": i,
        "text": echo + f.text,
        "finish_reason": f.finish_reason,
        "stop_reason": stop_reason(f, body.stop_token_ids),
        "logprobs": logprobs,
    }
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(g, f, body.prompt_logprobs)
    if body.return_token_ids:  # vLLM's
        choice["prompt_token_ids"], choice["token_ids"] = f.prompt_token_ids, f.token_ids
    if body.return_hidden_states:  # SGLang's
        choice["hidden_states"] = last_hidden_state(f)
    return choice


def _without_completion(f: p.GenerateFinal) -> p.GenerateFinal:
    """``f`` with its one token dropped (``max_tokens: 0``: the prompt was all it asked for)."""
    usage = msgspec.structs.replace(f.usage, completion_tokens=0)
    return msgspec.structs.replace(
        f, text="", token_ids=[], logprobs=[], usage=usage, finish_reason="length"
    )


def _echo_text(g: Gateway, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    if not g.tokenizer:
        raise invalid(
            "echo of a token-id prompt needs the gateway's tokenizer (--tokenizer)", param="echo"
        )
    return g.tokenizer.decode(prompt)


async def _completion_events(
    g: Gateway,
    events: AsyncIterator[tuple[int, Any]],
    rid: str,
    created: int,
    model: str,
    body: CompletionRequest,
    echoes: list[str],
) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        out = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": choices,
        }
        out.update(usage_of.field(choices))
        out.update(extra)
        return event(out)

    want_lp, want_ids = body.logprobs is not None, body.return_token_ids
    usage_of = body.chunk_usage()
    offsets: dict[int, int] = {}
    done: dict[int, p.GenerateFinal] = {}
    async for i, ev in events:
        if i not in offsets:
            usage_of.started(i, ev)
            echo = echoes[i // body.n]
            offsets[i] = len(echo)
            first = {"prompt_token_ids": ev.prompt_token_ids} if want_ids else {}
            if echo or first:  # vLLM's return_token_ids: the prompt's on the first chunk
                yield chunk(
                    [{"index": i, "text": echo, "logprobs": None, "finish_reason": None, **first}]
                )
        usage_of.add(i, ev)
        if isinstance(ev, p.GenerateChunk):
            if ev.text or (want_lp and ev.logprobs) or (want_ids and ev.token_ids):
                lps = (
                    completion_logprobs(g, ev.logprobs, offsets[i], body.return_tokens_as_token_ids)
                    if want_lp
                    else None
                )
                offsets[i] += len(ev.text)
                ids = {"token_ids": ev.token_ids} if want_ids else {}
                yield chunk(
                    [{"index": i, "text": ev.text, "logprobs": lps, "finish_reason": None, **ids}]
                )
        else:
            done[i] = ev
            last = {"index": i, "text": "", "logprobs": None, "finish_reason": ev.finish_reason}
            yield chunk([{**last, "stop_reason": stop_reason(ev, body.stop_token_ids)}])
            if body.return_hidden_states:  # SGLang's: after the choice's last chunk
                hidden = {"index": i, "text": "", "logprobs": None, "finish_reason": None}
                yield chunk([{**hidden, "hidden_states": last_hidden_state(ev)}])
    if body.include_usage:
        if len(done) != len(echoes) * body.n:
            raise APIError(500, "a choice ended without a final message", type="internal_error")
        ordered = [done[i] for i in sorted(done)]
        groups = [ordered[k : k + body.n] for k in range(0, len(ordered), body.n)]
        yield chunk([], usage=usage(groups, g))
    yield DONE
