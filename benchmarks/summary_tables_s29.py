"""The generated tables of session 29's work on the AMD machine (2026-12-05): speculative
decoding turned off by the scheduler's load (running and waiting requests) rather than by the
step's decodes, and only for requests that began under it; the 16-at-a-time phase in many
rounds of chats of their own;
summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial

from results_data import load, rounds_over_off
from summary_tables_s22 import _head, _row
from summary_tables_s23 import long_context_tables
from summary_tables_s27 import table_speculative_streamed

SPECULATIVE = "bench_speculative_s29.json"
SPECULATIVE_DECODES = "bench_speculative_s29_decodes.json"
SPECULATIVE_NEW = "bench_speculative_s29_new_requests.json"
DRAFT_TREE = "bench_draft_tree_s29.json"
GEMV_ROWS = "bench_gemv_rows_s28.json"
LONG_CONTEXT_GAP = "bench_long_context_s29_gap.json"


def table_speculative_rounds(name: str) -> str:
    """bench_speculative.py's 16-at-a-time phase over many rounds: per configuration its
    output tokens/s and its tokens/s over no speculation's in the same round (median and
    range), the rounds under no speculation's, and what it drafted and accepted in all."""
    rounds = load(name)["concurrent"]["rounds"]
    out = _head(
        "drafter",
        "rounds",
        "output tok/s: median (range)",
        "over off, same round: median (range)",
        "rounds under off",
        "drafted",
        "accepted",
        align="lrrrrrr",
    )
    for config in dict.fromkeys(r["config"] for r in rounds):
        mine = [r for r in rounds if r["config"] == config]
        xs = sorted(r["tokens_per_s"] for r in mine)
        ratios = sorted(rounds_over_off(rounds, config))
        out.append(
            _row(
                config,
                len(mine),
                f"{statistics.median(xs):.0f} ({xs[0]:.0f}-{xs[-1]:.0f})",
                f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})",
                sum(x < 1 for x in ratios),
                sum(r["drafted"] for r in mine),
                sum(r["accepted"] for r in mine),
            )
        )
    return "\n".join(out)


def linears_ms(rows: float, gemv: list[dict[str, float]]) -> float:
    """A pass over every linear at ``rows`` rows on the GEMV kernel (bench_gemv_rows.py's
    passes, linear between the row counts it timed; past the last, its last slope)."""
    pts = sorted((r["rows"], r["tree_ms"]) for r in gemv)
    for (r0, t0), (r1, t1) in zip(pts, pts[1:], strict=False):
        if rows <= r1 or (r1, t1) == pts[-1]:
            return t0 + (rows - r0) * (t1 - t0) / (r1 - r0)
    return pts[0][1]


def table_draft_tree() -> str:
    """bench_draft_tree.py: per workload and shape (the chain, trees of B branches) the
    verify steps, tokens and rows per step, tokens per step over the chain's; and, modeled,
    tokens per millisecond of the step's linears (bench_gemv_rows.py's passes at that many
    rows, interpolated) over the chain's: what a tree's extra rows would cost on this CPU."""
    d = load(DRAFT_TREE)
    gemv = load(GEMV_ROWS)["kernel"]
    out = _head(
        "workload",
        "shape",
        "verify steps",
        "tokens per step",
        "rows per step",
        "tokens per step over the chain",
        "modeled tokens per ms of linears over the chain",
        align="llrrrrr",
    )
    res = d["results"]
    for workload in res["chain"]:
        chain = res["chain"][workload]
        chain_rate = chain["tokens_per_step"] / linears_ms(chain["rows_per_step"], gemv)
        for shape, per in res.items():
            t = per[workload]
            rate = t["tokens_per_step"] / linears_ms(t["rows_per_step"], gemv)
            out.append(
                _row(
                    workload,
                    shape,
                    t["steps"],
                    f"{t['tokens_per_step']:.2f}",
                    f"{t['rows_per_step']:.2f}",
                    f"{t['tokens_per_step_over_chain']:.2f}",
                    f"{rate / chain_rate:.2f}",
                )
            )
    return "\n".join(out)


def table_long_context_gap_floors() -> str:
    """The HTTP-against-in-process run's floors, repetition by repetition: the read bandwidth
    sampled before it and the KV read floor it gives a token at 1,000 and 7,500 tokens."""
    d = load(LONG_CONTEXT_GAP)
    out = _head(
        "repetition",
        "read GB/s sampled",
        "KV read floor, ms a token at 1,000",
        "at 7,500",
        align="rrrr",
    )
    floors = {(f["rep"], f["context"]): f for f in d["floors"]}
    for rep in sorted({r for r, _ in floors}):
        short, long = floors[(rep, 1000)], floors[(rep, 7500)]
        out.append(
            _row(
                rep,
                f"{short['read_gbs']:.1f}",
                f"{short['kv_floor_ms']['auto']:.2f}",
                f"{long['kv_floor_ms']['auto']:.2f}",
            )
        )
    return "\n".join(out)


TABLES: dict[str, Callable[[], str]] = {
    "speculative_load_streamed": partial(table_speculative_streamed, SPECULATIVE),
    "speculative_load_rounds": partial(table_speculative_rounds, SPECULATIVE),
    "speculative_decodes_rounds": partial(table_speculative_rounds, SPECULATIVE_DECODES),
    "speculative_new_requests_rounds": partial(table_speculative_rounds, SPECULATIVE_NEW),
    "draft_tree": table_draft_tree,
    **long_context_tables("long_context_gap_s29", LONG_CONTEXT_GAP),
    "long_context_gap_s29_floors": table_long_context_gap_floors,
}
