"""The generated tables of session 35's work on the AMD machine (2026-12-05): fp8 pages at
scale 1 read in place by the decode rows' narrow blocks (csrc/paged_attention_fp8.h), a
decode row's attention and a prefill's against the kernel before it, and session 32's
long-context command run twice with that kernel; summary_tables.TABLES lists them with the
others.
"""

from __future__ import annotations

from collections.abc import Callable

from summary_tables_s30 import long_context_run_tables
from summary_tables_s33 import table_quant_decode_blocks

FP8_DECODE = "bench_decode_attention_s35.json"
FP8_PREFILL = "bench_decode_attention_s35_prefill.json"
LONG_CONTEXT = "bench_long_context_s35.json"
LONG_CONTEXT_B = "bench_long_context_s35b.json"  # the same command again, same code

TABLES: dict[str, Callable[[], str]] = {
    "fp8_in_place_decode_s35": lambda: table_quant_decode_blocks(FP8_DECODE),
    "fp8_in_place_prefill_s35": lambda: table_quant_decode_blocks(FP8_PREFILL),
    **long_context_run_tables("_s35", LONG_CONTEXT),
    **long_context_run_tables("_s35b", LONG_CONTEXT_B),
}
