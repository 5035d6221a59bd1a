"""The generated tables of the sections added 2026-12-04 (agent sessions over HTTP,
speculative decoding, the MoE decode step), one function each; summary_tables.TABLES
lists them with the others."""

from __future__ import annotations

import statistics
from typing import Any

from results_data import load

SESSIONS_HTTP = ("bench_sessions_radixserve.json", "bench_sessions_vllm.json")
SPECULATIVE = "bench_speculative_s22.json"


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _head(*names: str, align: str) -> list[str]:
    return [_row(*names), _row(*("---:" if a == "r" else "---" for a in align))]


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


def table_sessions_http() -> str:
    """bench_sessions.py --peer: the same seeded agents-and-churn workload over HTTP, per
    server and configuration: the shape as it ran, context found, TTFT, churn throughput."""
    out = _head(
        "server: config",
        "pool / agents' context",
        "churn pools in the emptiest pause",
        "returning turns' previous prompt cached: mean",
        "p10",
        "turns >= 95 %",
        "returning TTFT p50 ms",
        "p90 ms",
        "churn tok/s",
        "lease hits / granted (expired, yielded, pages trimmed)",
        "errors",
        align="lrrrrrrrrlr",
    )
    for name in SESSIONS_HTTP:
        d = load(name)
        for config, r in d["results"].items():
            s = r["shape"]
            out.append(
                _row(
                    f"{d['args']['peer']}: {config}",
                    f"{s['pool_over_context']:.2f}x",
                    f"{s['churn_pools_per_pause_min']:.2f}",
                    f"{r['cached_fraction_mean']:.3f}",
                    f"{r['cached_fraction_p10']:.3f}",
                    f"{r['turns_at_least_95pct']:.3f}",
                    _ms(r["returning_ttft_ms_p50"]),
                    _ms(r["returning_ttft_ms_p90"]),
                    f"{r['churn_tokens_per_s']:.0f}",
                    _lease_counters(r.get("server_counters") or {}),
                    r["errors"],
                )
            )
    return "\n".join(out)


def _lease_counters(c: dict[str, float]) -> str:
    """The server's lease counters at the end of a run (radixserve's /metrics), one cell."""

    def get(name: str) -> int:
        return int(sum(v for k, v in c.items() if k.startswith(f"radixserve_session_{name}")))

    if not c:
        return "n/a"
    return (
        f"{get('lease_hits')} / {get('leases_granted')} ({get('lease_expiries')}, "
        f"{get('lease_yields')}, {get('lease_trimmed_pages')})"
    )


def _per_request_ms(d: dict[str, Any], config: str, workload: str) -> float:
    """Median milliseconds per output token over one configuration's requests of a workload
    (each request's wall time, prefill included, over its tokens)."""
    xs = [
        1000 * r["seconds"] / r["tokens"]
        for r in d["requests"]
        if r["config"] == config and r["workload"] == workload and r["tokens"]
    ]
    return statistics.median(xs)


def speculative_floor_ms(d: dict[str, Any]) -> float:
    """A bench_speculative.py run's weight-streaming floor per token: the median of the
    samples taken before and after its requests."""
    return statistics.median([d["floor"]["before"]["floor_ms"], d["floor"]["after"]["floor_ms"]])


def table_speculative(name: str = SPECULATIVE) -> str:
    """bench_speculative.py: one request at a time per drafter and workload: speed-up over no
    speculation (sum of tokens over sum of time), acceptance, and the median time per token
    against the weight-streaming floor measured in the same run."""
    d = load(name)
    floor = speculative_floor_ms(d)
    out = _head(
        "drafter",
        "workload",
        "requests",
        "tokens/s over off",
        "drafted",
        "accepted",
        "acceptance",
        "ms per token (median request)",
        "over the floor",
        align="llrrrrrrr",
    )
    for config, per in d["results"].items():
        for workload, row in per.items():
            ms = _per_request_ms(d, config, workload)
            out.append(
                _row(
                    config,
                    workload,
                    row["requests"],
                    f"{row.get('speedup_vs_off', 0.0):.2f}",
                    row["drafted"],
                    row["accepted"],
                    f"{row['acceptance_rate']:.2f}",
                    f"{ms:.1f}",
                    f"{ms / floor:.2f}",
                )
            )
    return "\n".join(out)


def table_speculative_concurrent(name: str = SPECULATIVE) -> str:
    """bench_speculative.py's 16-at-a-time shared-system phase: output tokens/s per round."""
    d = load(name)
    c = d["concurrent"]
    per: dict[str, list[float]] = {}
    drafted: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for r in c["rounds"]:
        per.setdefault(r["config"], []).append(r["tokens_per_s"])
        drafted[r["config"]] = drafted.get(r["config"], 0) + r["drafted"]
        accepted[r["config"]] = accepted.get(r["config"], 0) + r["accepted"]
    base = per.get("off")
    out = _head(
        "drafter",
        "output tok/s per round",
        "over off, round by round",
        "drafted",
        "accepted",
        align="llrrr",
    )
    for config, xs in per.items():
        ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(xs, base, strict=True)) if base else "n/a"
        out.append(
            _row(
                config,
                ", ".join(f"{x:.0f}" for x in xs),
                ratios,
                drafted[config],
                accepted[config],
            )
        )
    return "\n".join(out)


MOE = "bench_moe_s22.json"


def table_moe() -> str:
    """bench_moe.py: the MoE decode step against the dense model of the same active size, per
    batch: every round's step, the median over its weight-reading floor, experts touched."""
    d = load(MOE)
    out = _head(
        "batch",
        "model",
        "ms per step, per round",
        "over its floor",
        "experts touched a layer (of total)",
        "MoE over dense (median)",
        align="rlllrr",
    )
    experts = d["moe_config"]["num_experts"]
    for r in d["results"]:
        for model in ("moe", "dense"):
            m = r[model]
            out.append(
                _row(
                    r["batch"],
                    f"{d['family'] if model == 'moe' else d['dense_family']}",
                    ", ".join(f"{x:.1f}" for x in m["rounds_step_ms"]),
                    f"{m['floor_ratio_median']:.2f}",
                    f"{m['experts_touched_mean']:.1f} ({experts})" if model == "moe" else "dense",
                    f"{r['moe_over_dense_median']:.2f}" if model == "moe" else "",
                )
            )
    return "\n".join(out)
