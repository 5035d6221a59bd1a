"""Miss reports over HTTP: one request's (``return_cache_report``) and the server's
(``GET /cache_report``, an admin path: it is an aggregate of every tenant's prompts).

Workers report token ids; the gateway decodes them with its tokenizer (``token_id:N``
without one). One request's report never says ``other_namespace``: that another tenant
caches a prefix is exactly what cache salts hide, so a client reads ``never_cached``
there; the operator's aggregate (``/cache_report``, ``/metrics``) counts it by its name.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from radixserve.serving.http.gateway import Gateway
from radixserve.serving.wire import protocol as p

router = APIRouter()


def decode(g: Gateway, ids: list[int]) -> str:
    """The text of a few token ids (a whole-sequence decode where a tokenizer is loaded)."""
    tok = g.tokenizer
    if tok is not None:
        try:
            return str(tok.decode(ids))
        except Exception:  # an id outside the vocabulary must not fail the response
            pass
    return "".join(g.token_text(t) for t in ids)


def report_json(g: Gateway, r: p.CacheReport) -> dict[str, Any]:
    """One request's report as ``usage.prompt_tokens_details.cache_report``."""
    out: dict[str, Any] = {
        "reason": "never_cached" if r.reason == "other_namespace" else r.reason,
        "cached_tokens": r.cached_tokens,
    }
    if r.diverged_at is not None:
        out.update(
            diverged_at=r.diverged_at,
            before=decode(g, r.before),
            after=decode(g, r.after),
            before_ids=r.before,
            after_ids=r.after,
        )
        if r.cached_after:
            out.update(cached_after=decode(g, r.cached_after), cached_after_ids=r.cached_after)
    if r.evicted_by is not None:
        out.update(evicted_by=r.evicted_by, evicted_seconds_ago=r.evicted_s_ago)
    elif r.reason == "flushed" and r.evicted_s_ago is not None:
        out.update(flushed_seconds_ago=r.evicted_s_ago)
    return out


def server_report(g: Gateway, st: p.StatsReply, top: int = 10) -> dict[str, Any]:
    """Every live worker's counts added up: the divergence histogram and the most frequent
    divergence positions with decoded context (every prompt), reasons (the reported ones),
    flushes."""
    reasons: dict[str, int] = {}
    buckets: dict[str, int] = {}
    positions: dict[int, dict[str, Any]] = {}
    reports = prompts = flushes = flushed_pages = 0
    for w in st.workers:
        eng = w.engine
        reports += int(eng.get("cache_reports_total", 0))
        prompts += int(eng.get("cache_divergence_prompts_total", 0))
        flushes += int(eng.get("cache_flushes_total", 0))
        flushed_pages += int(eng.get("cache_flushed_pages_total", 0))
        for k, v in (eng.get("cache_miss_reasons") or {}).items():
            reasons[k] = reasons.get(k, 0) + int(v)
        for k, v in (eng.get("cache_divergence_buckets") or {}).items():
            buckets[k] = buckets.get(k, 0) + int(v)
        for e in eng.get("cache_divergence_top") or []:
            have = positions.get(e["index"])
            if have is None:
                positions[e["index"]] = dict(e, workers=[w.worker_id])
            else:
                have["count"] += e["count"]
                have["workers"].append(w.worker_id)
    best = sorted(positions.values(), key=lambda e: (-e["count"], e["index"]))[:top]
    return {
        "reports": reports,
        "prompts": prompts,
        "flushes": flushes,
        "flushed_pages": flushed_pages,
        "reasons": reasons,
        "divergence_buckets": buckets,
        "top_divergence": [
            {
                "index": e["index"],
                "count": e["count"],
                "workers": e["workers"],
                "before": decode(g, e["before"]),
                "after": decode(g, e["after"]),
                "cached_after": decode(g, e["cached_after"]),
            }
            for e in best
        ],
    }


@router.get("/cache_report")
async def cache_report(request: Request, top: int = 10) -> dict[str, Any]:
    g: Gateway = request.app.state.gateway
    await g.info()  # loads the tokenizer that decodes the context
    return server_report(g, await g.stats(), max(1, min(top, 100)))
