"""The generated tables of session 38's measurements on the AMD machine (2026-12-06): a decode
row's attention per layer with its bf16 scores two groups of keys at a time, against the
kernel before (8c22c4b) and a bare cold read of the same pages, on pages in ascending order
(as one request at a time holds them) and scattered at random; and the one command of
issue 44's runs again; summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial

from results_data import load
from summary_tables_s22 import _head, _row
from summary_tables_s27 import table_long_context_kv_dtypes
from summary_tables_s30 import long_context_run_tables

# bench_decode_attention.py --baseline 8c22c4b --read-floor, --pages ascending and scattered.
DECODE_AB = ("bench_decode_attention_s38.json", "bench_decode_attention_s38b.json")
LONG_CONTEXT = "bench_long_context_s38.json"  # session 32's command (int4 KV in it since 37)


def table_decode_ab(names: tuple[str, ...] = DECODE_AB) -> str:
    """Per pages' order, page dtype and context: a decode row's attention per layer from
    memory (cold) and from the caches (hot), the baseline's and this kernel's (medians), this
    kernel's over the baseline's (the median of the repetitions' ratios: the two were timed
    alternately), and a bare cold read of the same pages with this kernel's cold time over
    it."""
    out = _head(
        "pages",
        "dtype",
        "context",
        "cold us, before / now",
        "hot us, before / now",
        "cold now over before",
        "hot now over before",
        "pages read cold, us",
        "cold now over the read",
        align="llrrrrrrr",
    )
    for name in names:
        d = load(name)
        base = d["baseline"]
        for r in d["results"]:
            us, s = r["us_per_layer"], r["samples_us"]

            def ratio(kind: str, s: dict = s) -> str:
                pairs = zip(s[f"current {kind}"], s[f"{base} {kind}"], strict=True)
                return f"{statistics.median(a / b for a, b in pairs):.2f}"

            out.append(
                _row(
                    d["pages"],
                    r["dtype"],
                    r["context"],
                    f"{us[f'{base} cold']:.0f} / {us['current cold']:.0f}",
                    f"{us[f'{base} hot']:.0f} / {us['current hot']:.0f}",
                    ratio("cold"),
                    ratio("hot"),
                    f"{us['read cold']:.0f}",
                    f"{us['current cold'] / us['read cold']:.2f}",
                )
            )
    return "\n".join(out)


TABLES: dict[str, Callable[[], str]] = {
    "decode_ab_s38": table_decode_ab,
    **long_context_run_tables("_s38", LONG_CONTEXT),
    # Its KV dtypes' table with int4 in it.
    "long_context_kv_dtypes_s38": partial(
        table_long_context_kv_dtypes, LONG_CONTEXT, ("int8", "int4", "fp8_e4m3")
    ),
}
