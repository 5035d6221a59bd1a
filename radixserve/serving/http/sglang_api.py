"""SGLang-native routes: ``/generate``, ``/abort_request``, ``/get_model_info``,
``/get_load``, ``/flush_cache``, ``/health``, ``/health_generate``, ``/get_server_info``
(and the newer ``/model_info``, ``/server_info``).

Enough of SGLang's server API that its frontend language runs programs against
radixserve with ``sgl.RuntimeEndpoint(url)``. Response shape of one ``/generate`` item::

    {"text": ..., "output_ids": [...],
     "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", ...},
                   "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
                   # with return_logprob: [logprob, token_id, text-or-None] triples
                   "input_token_logprobs", "output_token_logprobs",
                   "input_top_logprobs", "output_top_logprobs",
                   # with return_hidden_states (final message only): the final norm's
                   # output, first every prompt position's [[...], ...], then one [...] per
                   # output token but the last (the model never reads it)
                   "hidden_states"}}

SGLang's ``hidden_states[0]`` holds only the positions its prefill computed (a cached
prefix's are missing); here a request asking recomputes its whole prompt, as prompt
logprobs do, so ``hidden_states[0]`` always has every prompt position.

A batch (a list of prompts, or ``n`` > 1) answers a list, in prompt-major order. With
``stream`` each ``data:`` line carries the *cumulative* text, output ids and token counts so
far (and ``index`` in a batch), but only the new tokens' output logprobs, as SGLang's
frontend concatenates them; the stream ends with ``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from radixserve import __version__
from radixserve.sampling_params import SamplingParams
from radixserve.serving.http.aborts import abort_owner, abort_scope
from radixserve.serving.http.auth import request_key, tenant_cache_salt
from radixserve.serving.http.cache_report import report_json
from radixserve.serving.http.errors import APIError, invalid
from radixserve.serving.http.gateway import Gateway, merge, to_builtins
from radixserve.serving.http.sglang_protocol import AbortReqInput, GenerateReqInput, Item, expand
from radixserve.serving.http.sse import DONE, SSEResponse, event
from radixserve.serving.http.streams import finals, logprob, primed, stop_reason
from radixserve.serving.wire import protocol as p

router = APIRouter()


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway


class _Plan:
    """One item's parameters and what its answer needs."""

    def __init__(
        self, item: Item, params: SamplingParams, drop: bool, text_in_logprobs: bool
    ) -> None:
        self.item, self.params, self.drop, self.text_in_logprobs = (
            item,
            params,
            drop,
            text_in_logprobs,
        )


def _finish_reason(plan: _Plan, f: p.GenerateFinal, eos: list[int]) -> dict[str, Any]:
    if plan.drop:
        return {"type": "length", "length": 0}
    if f.finish_reason == "length":
        return {"type": "length", "length": f.usage.completion_tokens}
    if f.finish_reason == "stop":
        return {"type": "stop", "matched": stop_reason(f, [*eos, *plan.params.stop_token_ids])}
    return {"type": "abort", "message": f"request ended: {f.finish_reason}"}


def _logprob_meta(
    g: Gateway,
    plan: _Plan,
    outs: list[p.TokenLogprob],
    final: p.GenerateFinal | None,
    total: int,
) -> dict[str, Any]:
    """The ``meta_info`` logprob fields of one item: ``[logprob, token_id, text-or-None]``
    triples of the prompt (from ``logprob_start_len``, when ``final`` is the item's last
    message) and of the output tokens ``outs`` (all of them, or a streamed message's new
    ones), each with its ``top_logprobs_num`` likeliest and, with ``token_ids_logprob``, the
    named tokens' (SGLang's ``*_token_ids_logprobs``); ``total``: output logprobs so far."""
    text_of = g.token_text if plan.text_in_logprobs else (lambda _tid: None)
    named = plan.params.logprob_token_ids

    def tops(top: list[tuple[int, float]] | None) -> list[list[Any]] | None:
        if plan.item.top_logprobs_num <= 0 or top is None:
            return None
        return [[logprob(v), tid, text_of(tid)] for tid, v in top]

    def asked(values: list[float] | None) -> list[list[Any]] | None:
        if values is None or not named:
            return None
        return [[logprob(v), tid, text_of(tid)] for tid, v in zip(named, values)]

    inputs: list[list[Any]] = []
    input_tops: list[list[list[Any]] | None] = []
    input_asked: list[list[list[Any]] | None] = []
    if final is not None and final.prompt_logprobs is not None and final.prompt_token_ids:
        values, ids, prompt_tops = (
            final.prompt_logprobs,
            final.prompt_token_ids,
            final.prompt_top_logprobs,
        )
        prompt_asked = final.prompt_asked_logprobs
        start = len(ids) - len(values)
        for k, value in enumerate(values):
            tid = ids[start + k]
            inputs.append([None if value is None else logprob(value), tid, text_of(tid)])
            input_tops.append(tops(prompt_tops[k] if prompt_tops and value is not None else None))
            input_asked.append(
                asked(prompt_asked[k] if prompt_asked and value is not None else None)
            )
    meta = {
        "input_token_logprobs": inputs,
        "output_token_logprobs": [
            [logprob(lp.logprob), lp.token_id, text_of(lp.token_id)] for lp in outs
        ],
        "output_token_logprobs_length": total,
        "input_top_logprobs": input_tops,
        "output_top_logprobs": [tops(lp.top or []) for lp in outs],
    }
    if named:
        meta["input_token_ids_logprobs"] = input_asked
        meta["output_token_ids_logprobs"] = [asked(lp.asked) for lp in outs]
    return meta


def result(
    g: Gateway, plan: _Plan, f: p.GenerateFinal, eos: list[int], streamed: int = 0
) -> dict[str, Any]:
    """One item's answer in SGLang's shape (``streamed``: output logprobs already sent in
    chunks, left out of the output logprob lists here)."""
    it = plan.item
    completion = 0 if plan.drop else f.usage.completion_tokens
    meta: dict[str, Any] = {
        "id": it.rid,
        "finish_reason": _finish_reason(plan, f, eos),
        "prompt_tokens": f.usage.prompt_tokens,
        "completion_tokens": completion,
        "cached_tokens": f.usage.cached_tokens,
        "e2e_latency": f.timings.total_s,
        "weight_version": f.weight_version,
    }
    if f.usage.cache_report is not msgspec.UNSET:
        meta["cache_report"] = report_json(g, f.usage.cache_report)
    if it.return_logprob:
        outs = [] if plan.drop else (f.logprobs or [])
        meta.update(_logprob_meta(g, plan, outs[streamed:], f, len(outs)))
    if it.return_hidden_states and f.hidden_states is not None:
        meta["hidden_states"] = _hidden_meta(f.hidden_states, f.usage.prompt_tokens)
    return {
        "text": "" if plan.drop else f.text,
        "output_ids": [] if plan.drop else list(f.token_ids),
        "meta_info": meta,
    }


def _hidden_meta(hidden: list[list[float]], prompt_tokens: int) -> list[Any]:
    """SGLang's ``meta_info.hidden_states``: the prompt positions' vectors as one list,
    then one vector per later position (one per decode step)."""
    return [hidden[:prompt_tokens], *hidden[prompt_tokens:]]


@router.post("/generate", response_model=None)
async def generate(body: GenerateReqInput, request: Request) -> Response:
    arrival = time.monotonic()
    g = _gw(request)
    info = await g.info()
    items, single = expand(body, uuid.uuid4().hex)
    g.check_batch(len(items))
    plans = []
    for it in items:
        params, drop = it.sampling.to_params(
            info.context_length,
            info.vocab_size,
            it.top_logprobs_num if it.return_logprob else None,
            it.logprob_start_len if it.return_logprob and it.logprob_start_len >= 0 else None,
            it.sample,
            it.token_ids_logprob,
        )
        if body.return_cache_report:
            params = msgspec.structs.replace(params, return_cache_report=True)
        if it.return_hidden_states:
            params = msgspec.structs.replace(params, return_hidden_states=True)
        plans.append(_Plan(it, params, drop, body.return_text_in_logprobs))
    key = request_key(request.scope)
    salt = tenant_cache_salt(key, body.cache_salt)
    streams = [
        g.stream(
            arrival=arrival,
            text=pl.item.text,
            input_ids=pl.item.input_ids,
            params=pl.params,
            session_id=body.session_id,
            cache_salt=salt,
            priority=body.priority,
            lora=pl.item.lora,
            abort_scope=abort_scope(key, pl.item.rid, pl.item.prompt_rid),
        )
        for pl in plans
    ]
    if body.stream:
        events = await primed(request, merge(streams))
        return SSEResponse(_events(g, plans, events, info.eos_token_ids, batched=not single))
    results = await finals(request, streams)
    out = [result(g, pl, f, info.eos_token_ids) for pl, f in zip(plans, results)]
    return JSONResponse(out[0] if single else out)


async def _events(
    g: Gateway,
    plans: list[_Plan],
    events: AsyncIterator[tuple[int, Any]],
    eos: list[int],
    batched: bool,
) -> AsyncIterator[bytes]:
    # As SGLang's frontend reads a stream: every message carries the cumulative text, output ids
    # and counts, and the logprobs of its new output tokens only (the frontend concatenates
    # them); the prompt's logprobs come with the last message.
    texts = [""] * len(plans)
    ids: list[list[int]] = [[] for _ in plans]
    sent = [0] * len(plans)  # output logprobs streamed so far
    prompt_tokens: list[int | None] = [
        None if pl.item.input_ids is None else len(pl.item.input_ids) for pl in plans
    ]
    async for i, ev in events:
        pl = plans[i]
        if isinstance(ev, p.GenerateChunk):
            if ev.prompt_tokens is not None:
                prompt_tokens[i] = ev.prompt_tokens
            if pl.drop or not (ev.text or ev.token_ids):
                continue
            texts[i] += ev.text
            ids[i].extend(ev.token_ids)
            meta: dict[str, Any] = {
                "id": pl.item.rid,
                "finish_reason": None,
                "completion_tokens": len(ids[i]),
            }
            if prompt_tokens[i] is not None:
                meta["prompt_tokens"] = prompt_tokens[i]
            if pl.item.return_logprob:
                new = ev.logprobs or []
                sent[i] += len(new)
                meta.update(_logprob_meta(g, pl, new, None, sent[i]))
            payload: dict[str, Any] = {
                "text": texts[i],
                "output_ids": list(ids[i]),
                "meta_info": meta,
            }
        else:
            payload = result(g, pl, ev, eos, streamed=sent[i])
        if batched:
            payload["index"] = i
        yield event(payload)
    yield DONE


# ---------------------------------------------------------------------------- control


@router.post("/abort_request")
async def abort_request(body: AbortReqInput, request: Request) -> JSONResponse:
    """Stop the caller's requests in flight named ``rid`` (or all of them, ``abort_all``):
    each ends with finish reason ``abort`` and what it had generated (http/aborts.py). An
    unknown or finished rid stops nothing; ``aborted`` says how many were stopped."""
    if not body.abort_all and not body.rid:
        raise invalid("name the request to abort (rid) or send abort_all", param="rid")
    owner = abort_owner(request_key(request.scope))
    aborted = await _gw(request).abort(owner, None if body.abort_all else body.rid)
    return JSONResponse({"aborted": aborted})


@router.get("/get_load")
async def get_load(request: Request) -> JSONResponse:
    """SGLang's load report, what its router (sgl-router) balances workers by: one entry per
    live worker, as SGLang gives one per data-parallel rank (``num_reqs`` running and
    waiting, ``num_tokens`` the KV tokens in use), from the loads the workers last reported."""
    g = _gw(request)
    page_size = (await g.info()).page_size
    loads = [
        {
            "dp_rank": w.worker_id,
            "num_reqs": w.load.running + w.load.waiting,
            "num_waiting_reqs": w.load.waiting,
            "num_tokens": w.load.in_use_pages * page_size,
        }
        for w in (await g.stats()).workers
        if w.alive
    ]
    return JSONResponse(loads)


async def _model_info(request: Request) -> dict[str, Any]:
    g = _gw(request)
    info = await g.fresh_info()  # the weights may have been updated since
    # SGLang answers the path the model was loaded from: clients load the tokenizer from it.
    path = info.model_path or await g.model_name()
    return {
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": await g.model_name(),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": info.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": None,
        "architectures": None,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "eos_token_ids": info.eos_token_ids,
        "page_size": info.page_size,
        "num_workers": info.num_workers,
    }


router.add_api_route("/get_model_info", _model_info, methods=["GET"])
router.add_api_route("/model_info", _model_info, methods=["GET"])


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    ok = await _gw(request).flush_cache()
    if ok:
        return PlainTextResponse("Cache flushed.\n")
    return PlainTextResponse(
        "Cache not flushed: a worker has requests running or waiting.\n", status_code=400
    )


@router.get("/health")
async def health(request: Request) -> Response:
    if _gw(request).warming_up:
        raise APIError(503, "warming up", type="service_unavailable", code="warming_up")
    h = await _gw(request).health()
    if not h.ok:
        raise APIError(503, "no live worker", type="service_unavailable", code="no_workers")
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy when a one-token generation goes through a worker.

    A server whose generation is paused or whose memory is released is up but not ready:
    its probe would be held until a resume that may be minutes away (an RL step's training
    phase), so it answers 503 at once and says why, as a readiness probe needs."""
    g = _gw(request)
    info = await g.fresh_info()
    if info.memory_released:
        tags = ", ".join(info.memory_released)
        raise APIError(503, f"memory released ({tags})", type="service_unavailable", code="asleep")
    if info.paused is not None:
        raise APIError(
            503, f"generation paused ({info.paused})", type="service_unavailable", code="paused"
        )
    await g.generate(
        arrival=time.monotonic(), text="Hi", params=SamplingParams(max_tokens=1, temperature=0.0)
    )
    return Response(status_code=200)


async def _server_info(request: Request) -> dict[str, Any]:
    """Model, router counters and, per worker, its engine stats and device memory snapshot."""
    g = _gw(request)
    info, st = await g.info(), await g.stats()
    workers = to_builtins(st.workers)
    return {
        "version": __version__,
        "model_path": await g.model_name(),
        "context_length": info.context_length,
        "page_size": info.page_size,
        "router_endpoint": g.config.router,
        "uptime_s": time.time() - g.started,
        "routing": st.routing,
        "requests": st.requests,
        "active": st.active,
        "aborted": st.aborted,
        "errors": st.errors,
        "workers": workers,
        "memory": {str(w["worker_id"]): w["engine"].get("memory") for w in workers if w["alive"]},
        "internal_states": [w["engine"] for w in workers if w["alive"]],
    }


router.add_api_route("/get_server_info", _server_info, methods=["GET"])
router.add_api_route("/server_info", _server_info, methods=["GET"])
