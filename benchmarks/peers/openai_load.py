"""Replay a workload against an OpenAI-compatible server and measure it.

One client for every peer (radixserve's HTTP gateway, vLLM, llama.cpp's llama-server,
``transformers serve``), so the comparison differs only in the server. Each request
streams (``stream=True``, usage in the last chunk where the server supports
``stream_options.include_usage``); the client stamps every content chunk:

* TTFT: send -> first content chunk; ITL: gaps between content chunks (a chunk is one
  token on vLLM and llama-server; radixserve's gateway may merge tokens produced within
  one step, so TPOT = (e2e - TTFT) / (tokens - 1) is reported beside it);
* throughput: output tokens / wall time and (prompt + output) tokens / wall time, token
  counts from the server's usage, or from the client's tokenizer where usage is missing;
* hit rate: ``usage.prompt_tokens_details.cached_tokens`` / prompt tokens where reported.

Prompts go as token ids (``/v1/completions`` with ``prompt: [ids]``: every peer sees the
same tokens), or as chat messages (``/v1/chat/completions``) for servers without
token-id prompts. Sessions run concurrently up to ``concurrency``; a session's requests
go one after another.

The client is aiohttp, as in vLLM's ``benchmark_serving.py``: on a host whose cores also
run the server, the load generator's CPU per streamed token is taken from the server.
Measured against httpx on this project's 2-core VM (``radixserve-bf16``, one stream): 0.37
against 0.65 ms of client CPU per token.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np

__all__ = ["RequestResult", "replay", "summarize"]


@dataclass
class RequestResult:
    """What one streamed request measured."""

    ttft: float
    e2e: float
    itl: list[float]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    text: str
    finish_reason: str | None
    error: str | None = None
    usage_reported: bool = True
    start: float = 0.0


@dataclass
class ReplayConfig:
    """How to talk to one server."""

    base_url: str
    model: str
    mode: str = "ids"  # "ids" (/v1/completions, token-id prompt) | "text" | "chat"
    extra_body: dict[str, Any] = field(default_factory=dict)
    include_usage: bool = True
    timeout_s: float = 600.0


def usage_of(ev: dict[str, Any]) -> tuple[int, int | None, int] | None:
    """(prompt, cached or None, completion) tokens from an SSE event's ``usage``, or from
    llama.cpp's ``timings`` (``cache_n`` prompt tokens reused, ``prompt_n`` computed)."""
    u = ev.get("usage") or {}
    timings = ev.get("timings") or {}
    if not u and not timings:
        return None
    prompt = int(u.get("prompt_tokens") or 0)
    completion = int(u.get("completion_tokens") or 0)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and "cache_n" in timings:
        cached = timings["cache_n"]
        prompt = prompt or int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0))
        completion = completion or int(timings.get("predicted_n", 0))
    return prompt, (int(cached) if cached is not None else None), completion


def _request_body(cfg: ReplayConfig, req: Any, tokenizer: Any) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        **cfg.extra_body,
    }
    if cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    if cfg.mode == "chat":
        body["messages"] = [dict(m) for m in req.messages]
        return "/v1/chat/completions", body
    if cfg.mode == "text":
        body["prompt"] = tokenizer.decode(list(req.prompt_ids), skip_special_tokens=False)
    else:
        body["prompt"] = list(req.prompt_ids)
    return "/v1/completions", body


async def _one(
    client: aiohttp.ClientSession, cfg: ReplayConfig, req: Any, tokenizer: Any
) -> RequestResult:
    path, body = _request_body(cfg, req, tokenizer)
    t0 = time.perf_counter()
    stamps: list[float] = []
    pieces: list[str] = []
    usage: tuple[int, int | None, int] | None = None
    finish: str | None = None
    try:
        async with client.post(path, json=body) as resp:
            if resp.status != 200:
                detail = (await resp.read()).decode(errors="replace")[:500]
                raise RuntimeError(f"HTTP {resp.status}: {detail}")
            async for line in resp.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                ev = json.loads(data)
                usage = usage_of(ev) or usage
                for ch in ev.get("choices") or []:
                    piece = ch.get("text")
                    if piece is None:
                        piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        stamps.append(time.perf_counter())
                        pieces.append(piece)
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        end = time.perf_counter()
        return RequestResult(
            end - t0,
            end - t0,
            [],
            len(req.prompt_ids),
            0,
            None,
            "",
            None,
            error=f"{type(exc).__name__}: {exc}",
            start=t0,
        )
    end = time.perf_counter()
    text = "".join(pieces)
    if usage is not None:
        prompt = usage[0] or len(req.prompt_ids)
        completion = usage[2] or (
            len(tokenizer.encode(text, add_special_tokens=False)) if text else 0
        )
        cached = usage[1]
    else:  # the server sent no usage: count with the client's tokenizer
        prompt = len(req.prompt_ids)
        completion = len(tokenizer.encode(text, add_special_tokens=False)) if text else 0
        cached = None
    return RequestResult(
        ttft=(stamps[0] - t0) if stamps else end - t0,
        e2e=end - t0,
        itl=list(np.diff(stamps)) if len(stamps) > 1 else [],
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        text=text,
        finish_reason=finish,
        usage_reported=usage is not None,
        start=t0,
    )


async def replay(
    cfg: ReplayConfig, sessions: Sequence[Sequence[Any]], concurrency: int, tokenizer: Any
) -> tuple[list[list[RequestResult]], float]:
    """Run every session (its requests in order), ``concurrency`` sessions at a time.

    Returns the per-session results and the wall time.
    """
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(
        base_url=cfg.base_url,
        timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
        connector=aiohttp.TCPConnector(limit=concurrency + 4),
        # Lines (SSE events) up to 2 MiB, not aiohttp's default 512 KiB: one event may carry a
        # long text or logprobs.
        read_bufsize=1 << 20,
    ) as client:

        async def session(reqs: Sequence[Any]) -> list[RequestResult]:
            async with sem:
                return [await _one(client, cfg, r, tokenizer) for r in reqs]

        t0 = time.perf_counter()
        results = await asyncio.gather(*(session(s) for s in sessions))
        wall = time.perf_counter() - t0
    return list(results), wall


def _pct(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    a = np.asarray(values, dtype=float) * scale
    return {f"p{q}": float(np.percentile(a, q)) if a.size else float("nan") for q in (50, 90, 99)}


def summarize(results: list[RequestResult], wall: float) -> dict[str, Any]:
    """Throughput, latency percentiles (ms), hit rate and error count of one replay."""
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = [r.cached_tokens for r in ok]
    hit = (
        (sum(c for c in cached if c is not None) / max(1, prompt_tokens))
        if ok and all(c is not None for c in cached)
        else None
    )
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "wall_s": wall,
        "req_per_s": len(ok) / wall if wall else 0.0,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tok_per_s": out_tokens / wall if wall else 0.0,
        "total_tok_per_s": (out_tokens + prompt_tokens) / wall if wall else 0.0,
        "hit_rate": hit,
        "cached_tokens": sum(c for c in cached if c is not None) if hit is not None else None,
        "ttft_ms": _pct([r.ttft for r in ok]),
        "itl_ms": _pct([x for r in ok for x in r.itl]),
        "tpot_ms": _pct(tpot),
        "e2e_s": _pct([r.e2e for r in ok], scale=1.0),
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
    }


def to_json(r: RequestResult) -> dict[str, Any]:
    """A compact record (the per-chunk gaps are summarized in the cell, not kept per request)."""
    d = asdict(r)
    d["itl_n"] = len(d.pop("itl"))
    for k in ("ttft", "e2e", "start"):
        d[k] = round(d[k], 4)
    return d
