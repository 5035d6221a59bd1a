"""The generated tables of session 37's measurements on the AMD machine (2026-12-06), with
int4 KV read by the CPU kernel: a decode row's attention per layer against a bare cold read
of its own pages for bf16, int8, int4 and fp8 pages, and the one command of issue 44's runs
with int4 KV in it; summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from summary_tables_s27 import table_long_context_kv_dtypes
from summary_tables_s30 import long_context_run_tables
from summary_tables_s36 import table_decode_floors

DECODE_FLOORS = "bench_decode_attention_s37.json"
LONG_CONTEXT = "bench_long_context_s37.json"  # session 32's command, int4 KV added

TABLES: dict[str, Callable[[], str]] = {
    "decode_floors_s37": partial(table_decode_floors, DECODE_FLOORS),
    **long_context_run_tables("_s37", LONG_CONTEXT),
    # Its KV dtypes' table with int4 in it.
    "long_context_kv_dtypes_s37": partial(
        table_long_context_kv_dtypes, LONG_CONTEXT, ("int8", "int4", "fp8_e4m3")
    ),
}
