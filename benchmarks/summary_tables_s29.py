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

from results_data import load
from summary_tables_s22 import _head, _row
from summary_tables_s27 import table_speculative_streamed

SPECULATIVE = "bench_speculative_s29.json"
SPECULATIVE_DECODES = "bench_speculative_s29_decodes.json"
SPECULATIVE_NEW = "bench_speculative_s29_new_requests.json"


def table_speculative_rounds(name: str) -> str:
    """bench_speculative.py's 16-at-a-time phase over many rounds: per configuration its
    output tokens/s and its tokens/s over no speculation's in the same round (median and
    range), the rounds under no speculation's, and what it drafted and accepted in all."""
    rounds = load(name)["concurrent"]["rounds"]
    rate = {(r["config"], r["round"]): r["tokens_per_s"] for r in rounds}
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
        ratios = sorted(r["tokens_per_s"] / rate[("off", r["round"])] for r in mine)
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


TABLES: dict[str, Callable[[], str]] = {
    "speculative_load_streamed": partial(table_speculative_streamed, SPECULATIVE),
    "speculative_load_rounds": partial(table_speculative_rounds, SPECULATIVE),
    "speculative_decodes_rounds": partial(table_speculative_rounds, SPECULATIVE_DECODES),
    "speculative_new_requests_rounds": partial(table_speculative_rounds, SPECULATIVE_NEW),
}
