"""The generated tables of session 31's work on the AMD machine (2026-12-05): a decode
step's attention over int8 and fp8 pages against bf16 pages, with the int8 scales read
and prefetched with their codes; and two long-context runs through HTTP after it;
summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

from collections.abc import Callable

from results_data import load
from summary_tables_s22 import _head, _row
from summary_tables_s30 import long_context_run_tables

QUANT_DECODE = "bench_decode_attention_s31_quant.json"
LONG_CONTEXT = "bench_long_context_s31b.json"
LONG_CONTEXT_C = "bench_long_context_s31c.json"


def table_quant_decode_attention(name: str = QUANT_DECODE) -> str:
    """bench_decode_attention.py --read-floor over several page dtypes: per dtype and
    context, a decode row's attention per layer from memory (cold), the baseline kernel's,
    from the caches (hot), a bare cold read of the same pages (codes only), and the cold
    time over bf16 pages' cold time at the same context (issue 44: quantized KV no slower)."""
    d = load(name)
    base = d["baseline"]
    bf16 = {
        r["context"]: r["us_per_layer"]["current cold"]
        for r in d["results"]
        if r["dtype"] == "bfloat16"
    }
    out = _head(
        "pages",
        "context",
        "cold us per layer",
        f"cold at {base}",
        "over it",
        "hot us per layer",
        "pages read cold, us",
        "cold over bf16 pages' cold",
        "same bits",
        align="lrrrrrrrl",
    )
    for r in d["results"]:
        us = r["us_per_layer"]
        cold = us["current cold"]
        out.append(
            _row(
                r["dtype"],
                r["context"],
                f"{cold:.0f}",
                f"{us[f'{base} cold']:.0f}",
                f"{cold / us[f'{base} cold']:.2f}",
                f"{us['current hot']:.0f}",
                f"{us['read cold']:.0f}",
                f"{cold / bf16[r['context']]:.2f}",
                "yes" if r["outputs_equal"] else "no",
            )
        )
    return "\n".join(out)


TABLES: dict[str, Callable[[], str]] = {
    "quant_decode_attention_s31": table_quant_decode_attention,
    **long_context_run_tables("_s31b", LONG_CONTEXT),
    **long_context_run_tables("_s31c", LONG_CONTEXT_C),
}
