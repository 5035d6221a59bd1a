"""Prometheus metrics of the gateway (``GET /metrics``), per worker.

Two sources:

* Latency histograms (TTFT, inter-token latency, end-to-end) and finished-request
  counters are observed by the gateway itself, as each request's tokens arrive, and
  labelled with the worker that ran the request.
* Engine gauges and counters (requests running/waiting, KV pages free/evictable/in use,
  prefix-cache queried/hit tokens, retractions, evictions, prompt/generation tokens,
  device memory) live in the workers. They are mirrored from the router's
  :class:`~radixserve.serving.wire.protocol.StatsReply`, fetched at scrape time, by a custom
  collector: the engine's monotonic ``*_total`` counts are exposed as Prometheus counters,
  so any window's prefix-cache hit rate is
  ``rate(radixserve_prefix_cache_hit_tokens_total[5m]) / rate(radixserve_prefix_cache_queried_tokens_total[5m])``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from radixserve.serving.wire import protocol as p

PREFIX = "radixserve"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Engine stats field -> (metric name without _total, help). Monotonic over a worker's life.
_ENGINE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "prompt_tokens_total",
        "prefix_cache_queried_tokens",
        "prompt tokens looked up in the radix cache",
    ),
    (
        "cached_prompt_tokens_total",
        "prefix_cache_hit_tokens",
        "prompt tokens served from the radix cache",
    ),
    ("prompt_tokens_total", "prompt_tokens", "prompt tokens of admitted requests"),
    ("generated_tokens_total", "generation_tokens", "tokens generated"),
    (
        "computed_tokens_total",
        "computed_tokens",
        "token rows run through the model (extend + decode)",
    ),
    (
        "retractions_total",
        "retractions",
        "running requests retracted (KV freed, re-queued) for lack of pages",
    ),
    ("evicted_pages_total", "evicted_pages", "radix-cache pages evicted (LRU) to make room"),
    ("cache_flushes_total", "cache_flushes", "radix-cache flushes (/flush_cache, resets)"),
    (
        "cache_flushed_pages_total",
        "cache_flushed_pages",
        "radix-cache pages dropped by flushes (not evictions: no policy's regret)",
    ),
    (
        "cache_divergence_prompts_total",
        "cache_divergence_prompts",
        "admitted prompts whose divergence position was counted (all of them)",
    ),
    ("leases_granted_total", "session_leases_granted", "session leases granted at turn ends"),
    ("lease_hits_total", "session_lease_hits", "session turns that found their lease held"),
    ("lease_expired_total", "session_lease_expiries", "session leases that ran out"),
    (
        "lease_yielded_total",
        "session_lease_yields",
        "session leases released early under memory pressure",
    ),
    (
        "lease_trimmed_pages_total",
        "session_lease_trimmed_pages",
        "leased pages taken from the tail of the oldest lease under memory pressure",
    ),
    ("sessions_adopted_total", "sessions_adopted", "unkeyed chats adopted as sessions"),
    (
        "lease_lost_tokens_total",
        "session_lease_lost_tokens",
        "prompt tokens recomputed that a session's lost lease had held",
    ),
    (
        "eviction_switches_total",
        "eviction_policy_switches",
        "times the adaptive eviction policy changed what it follows",
    ),
    ("finished_total", "engine_requests_finished", "requests the engine finished"),
    ("aborted_total", "engine_requests_aborted", "requests the engine aborted"),
    ("steps_total", "engine_steps", "scheduler steps"),
    (
        "spec_verifies_total",
        "spec_verifies",
        "speculative decoding: requests' draft verifications (one per request per verify step)",
    ),
    ("spec_drafted_tokens_total", "spec_draft_tokens", "speculative decoding: tokens drafted"),
    (
        "spec_accepted_tokens_total",
        "spec_accepted_tokens",
        "speculative decoding: drafted tokens the model accepted",
    ),
)
_MEMORY_FIELDS = ("allocated_bytes", "reserved_bytes", "total_bytes", "rss_bytes", "pool_bytes")


class WorkerStatsCollector(Collector):
    """Exposes the latest :class:`~radixserve.serving.wire.protocol.StatsReply` as metric families."""

    def __init__(self) -> None:
        self.stats: p.StatsReply | None = None

    def describe(self) -> list[Any]:
        return []  # dynamic: nothing to check at registration

    def collect(self) -> Iterator[Any]:
        st = self.stats
        if st is None:
            return
        families = _WorkerFamilies()
        for w in st.workers:
            families.add(w)
        yield from families.all()
        yield from _router_families(st)


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ("worker",)) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels))


class _WorkerFamilies:
    """One scrape's per-worker metric families, filled worker by worker."""

    def __init__(self) -> None:
        self.up = _gauge("worker_up", "1 while the worker is alive")
        self.running = _gauge("num_requests_running", "requests running in the worker's batch")
        self.waiting = _gauge("num_requests_waiting", "requests queued in the worker")
        self.inflight = _gauge(
            "num_requests_inflight",
            "requests the router has dispatched to the worker and not seen finish",
        )
        self.pages = {
            k: _gauge(f"kv_pages_{k}", f"KV cache pages: {k}")
            for k in ("total", "free", "evictable", "in_use")
        }
        self.usage = _gauge(
            "kv_usage_ratio", "fraction of KV pages in use by running requests (in_use / total)"
        )
        self.cached = _gauge("kv_cached_tokens", "tokens held by the radix cache")
        self.policy = _gauge(
            "eviction_policy_active",
            "1 for the eviction policy a worker follows now (adaptive: its current choice)",
            ("worker", "policy", "configured"),
        )
        self.regret = CounterMetricFamily(
            f"{PREFIX}_eviction_regret_tokens",
            "tokens each candidate policy recomputed within the horizon of evicting them "
            "(shadow caches; adaptive only)",
            labels=["worker", "policy"],
        )
        self.live_regret = CounterMetricFamily(
            f"{PREFIX}_cache_regret_tokens",
            "tokens the cache recomputed within the horizon of evicting them, by the policy "
            "that evicted them (the live cache, every policy)",
            labels=["worker", "policy"],
        )
        self.leased = _gauge(
            "kv_leased_pages", "radix-cache pages on a session's leased path (evicted last)"
        )
        self.divergence = HistogramMetricFamily(
            f"{PREFIX}_cache_divergence_position",
            "token index where admitted prompts left the longest cached path "
            "(every request; fully cached prompts are not counted)",
            labels=["worker"],
        )
        self.top_positions = _gauge(
            "cache_divergence_top",
            "prompts that diverged at each of the most frequent positions (the top 10)",
            ("worker", "position"),
        )
        self.reasons = CounterMetricFamily(
            f"{PREFIX}_cache_miss_reasons",
            "reported prompts (return_cache_report / --cache-report) by why the rest of "
            "the prompt was not cached",
            labels=["worker", "reason"],
        )
        self.draft_pages = {
            state: _gauge(
                "spec_draft_kv_pages" + ("" if state == "total" else f"_{state}"),
                f"speculative decoding's draft-model KV pool: {state} pages",
            )
            for state in ("total", "free", "evictable")
        }
        self.draft_bytes = _gauge(
            "spec_draft_kv_pool_bytes",
            "speculative decoding's draft-model KV pool bytes (outside the planner's budget)",
        )
        self.hit_rate = _gauge(
            "prefix_cache_hit_ratio",
            "cumulative cached / prompt tokens (use the counters for windows)",
        )
        self.counters = {
            name: CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["worker"])
            for _, name, doc in _ENGINE_COUNTERS
        }
        self.memory = {
            f: _gauge(
                f"memory_{f}",
                f"device memory snapshot: {f.replace('_', ' ')}",
                ("worker", "device"),
            )
            for f in _MEMORY_FIELDS
        }

    def add(self, w: p.WorkerStats) -> None:
        """One worker's sample of every family (a dead worker: only up and its counters)."""
        wid = [str(w.worker_id)]
        self.up.add_metric(wid, 1.0 if w.alive else 0.0)
        eng = w.engine
        for field, name, _ in _ENGINE_COUNTERS:
            if field in eng:
                self.counters[name].add_metric(wid, float(eng[field]))
        if not w.alive:
            return
        load = w.load
        self.inflight.add_metric(wid, float(w.inflight))
        self.running.add_metric(wid, float(eng.get("running", load.running)))
        self.waiting.add_metric(wid, float(eng.get("waiting", load.waiting)))
        total = eng.get("num_pages", load.num_pages)
        in_use = eng.get("pages_in_use", load.in_use_pages)
        self.pages["total"].add_metric(wid, float(total))
        self.pages["free"].add_metric(wid, float(eng.get("pages_free", load.free_pages)))
        self.pages["evictable"].add_metric(
            wid, float(eng.get("pages_evictable", load.evictable_pages))
        )
        self.pages["in_use"].add_metric(wid, float(in_use))
        self.usage.add_metric(wid, in_use / total if total else 0.0)
        if "cached_tokens" in eng:
            self.cached.add_metric(wid, float(eng["cached_tokens"]))
        if "eviction_policy_active" in eng:
            self.policy.add_metric(
                [*wid, str(eng["eviction_policy_active"]), str(eng.get("eviction_policy", ""))],
                1.0,
            )
        for name, tokens in (eng.get("eviction_regret_tokens") or {}).items():
            self.regret.add_metric([*wid, str(name)], float(tokens))
        if "leased_pages" in eng:
            self.leased.add_metric(wid, float(eng["leased_pages"]))
        self._add_misses(wid, eng)
        if eng.get("spec_draft_pages"):
            for state, key in (("total", ""), ("free", "_free"), ("evictable", "_evictable")):
                self.draft_pages[state].add_metric(wid, float(eng[f"spec_draft_pages{key}"]))
            self.draft_bytes.add_metric(wid, float(eng["spec_draft_pool_bytes"]))
        self.hit_rate.add_metric(wid, float(eng.get("hit_rate", w.hit_rate)))
        mem = eng.get("memory")
        if isinstance(mem, dict):
            for f in _MEMORY_FIELDS:
                if f in mem:
                    self.memory[f].add_metric([*wid, str(mem.get("device", ""))], float(mem[f]))

    def _add_misses(self, wid: list[str], eng: dict[str, Any]) -> None:
        """The worker's miss reports (memory.miss_report): divergence histogram, top
        positions, reasons."""
        buckets = eng.get("cache_divergence_buckets") or {}
        if buckets:
            self.divergence.add_metric(
                wid,
                [(le, float(n)) for le, n in buckets.items()],
                float(eng.get("cache_divergence_position_sum", 0)),
            )
        for e in (eng.get("cache_divergence_top") or [])[:10]:
            self.top_positions.add_metric([*wid, str(e["index"])], float(e["count"]))
        for reason, n in (eng.get("cache_miss_reasons") or {}).items():
            self.reasons.add_metric([*wid, str(reason)], float(n))
        for name, tokens in (eng.get("cache_regret_tokens") or {}).items():
            self.live_regret.add_metric([*wid, str(name)], float(tokens))

    def all(self) -> tuple[Any, ...]:
        return (
            self.up,
            self.running,
            self.waiting,
            self.inflight,
            *self.pages.values(),
            self.usage,
            self.cached,
            self.leased,
            self.policy,
            self.regret,
            self.live_regret,
            self.divergence,
            self.top_positions,
            self.reasons,
            self.hit_rate,
            *self.draft_pages.values(),
            self.draft_bytes,
            *self.counters.values(),
            *self.memory.values(),
        )


def _router_families(st: p.StatsReply) -> list[Any]:
    return [
        CounterMetricFamily(
            f"{PREFIX}_router_requests",
            "generate requests accepted by the router",
            value=st.requests,
        ),
        CounterMetricFamily(
            f"{PREFIX}_router_requests_aborted",
            "requests aborted (client abort or gone)",
            value=st.aborted,
        ),
        CounterMetricFamily(
            f"{PREFIX}_router_errors", "error replies sent by the router", value=st.errors
        ),
        GaugeMetricFamily(
            f"{PREFIX}_router_requests_active",
            "requests in flight in the router",
            value=st.active,
        ),
        GaugeMetricFamily(
            f"{PREFIX}_router_clients",
            "client connections with requests in flight",
            value=st.clients,
        ),
    ]


class GatewayMetrics:
    """The gateway's Prometheus registry: its own histograms plus the mirrored worker stats."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "time from HTTP arrival to the first token",
            ["worker"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "time between successive output tokens",
            ["worker"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "time from HTTP arrival to the last token",
            ["worker"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.finished = Counter(
            f"{PREFIX}_requests_finished",
            "generate requests finished, by reason",
            ["worker", "finish_reason"],
            registry=r,
        )
        self.request_prompt_tokens = Counter(
            f"{PREFIX}_request_prompt_tokens",
            "prompt tokens of finished requests",
            ["worker"],
            registry=r,
        )
        self.request_cached_tokens = Counter(
            f"{PREFIX}_request_cached_tokens",
            "prompt tokens of finished requests served from the radix cache",
            ["worker"],
            registry=r,
        )
        self.request_generation_tokens = Counter(
            f"{PREFIX}_request_generation_tokens",
            "tokens generated by finished requests",
            ["worker"],
            registry=r,
        )
        self.http_errors = Counter(
            f"{PREFIX}_http_errors",
            "HTTP requests answered with an error, by status",
            ["status"],
            registry=r,
        )
        self.workers = WorkerStatsCollector()
        r.register(self.workers)

    def observe_request(
        self, final: p.GenerateFinal, ttft_s: float | None, itl_s: list[float], e2e_s: float
    ) -> None:
        """Record one finished request (called when its final message arrives)."""
        w = str(final.worker_id)
        if ttft_s is not None:
            self.ttft.labels(w).observe(ttft_s)
        itl = self.itl.labels(w)
        for gap in itl_s:
            itl.observe(gap)
        self.e2e.labels(w).observe(e2e_s)
        self.finished.labels(w, final.finish_reason).inc()
        self.request_prompt_tokens.labels(w).inc(final.usage.prompt_tokens)
        self.request_cached_tokens.labels(w).inc(final.usage.cached_tokens)
        self.request_generation_tokens.labels(w).inc(final.usage.completion_tokens)

    def update(self, stats: p.StatsReply) -> None:
        """Take a fresh router stats snapshot (the worker gauges and counters)."""
        self.workers.stats = stats

    def render(self) -> bytes:
        """The Prometheus text exposition of everything."""
        return generate_latest(self.registry)
