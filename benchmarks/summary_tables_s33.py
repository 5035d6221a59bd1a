"""The generated tables of session 33's work on the AMD machine (2026-12-05): quantized
pages decoded a block of 64 keys at a time, as the kernel attends to them, into rows that
stay in L1, and session 32's long-context command run again with that kernel;
summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

from collections.abc import Callable

from results_data import load
from summary_tables_s22 import _head, _row
from summary_tables_s30 import long_context_run_tables

QUANT_BLOCKS = "bench_decode_attention_s33.json"
LONG_CONTEXT = "bench_long_context_s33.json"


def table_quant_decode_blocks(name: str = QUANT_BLOCKS) -> str:
    """bench_decode_attention.py --baseline over bf16, int8 and fp8 pages: per dtype and
    context, a decode row's attention per layer from memory (cold) and from the caches (hot),
    the baseline kernel's beside each, and each over bf16 pages' at the same context (issue
    44: quantized KV no slower; "not run" where the run timed no bf16 pages). Medians of the
    run's samples."""
    d = load(name)
    base = d["baseline"]
    bf16 = {r["context"]: r["us_per_layer"] for r in d["results"] if r["dtype"] == "bfloat16"}
    out = _head(
        "pages",
        "context",
        "cold us per layer",
        f"at {base}",
        "over it",
        "hot us per layer",
        f"at {base}",
        "over it",
        "cold over bf16's",
        "hot over bf16's",
        "same bits",
        align="lrrrrrrrrrl",
    )
    for r in d["results"]:
        us, ref = r["us_per_layer"], bf16.get(r["context"])
        cold, hot = us["current cold"], us["current hot"]
        out.append(
            _row(
                r["dtype"],
                r["context"],
                f"{cold:.0f}",
                f"{us[f'{base} cold']:.0f}",
                f"{cold / us[f'{base} cold']:.2f}",
                f"{hot:.0f}",
                f"{us[f'{base} hot']:.0f}",
                f"{hot / us[f'{base} hot']:.2f}",
                f"{cold / ref['current cold']:.2f}" if ref else "not run",
                f"{hot / ref['current hot']:.2f}" if ref else "not run",
                "yes" if r["outputs_equal"] else "no",
            )
        )
    return "\n".join(out)


TABLES: dict[str, Callable[[], str]] = {
    "quant_decode_blocks_s33": table_quant_decode_blocks,
    **long_context_run_tables("_s33", LONG_CONTEXT),
}
