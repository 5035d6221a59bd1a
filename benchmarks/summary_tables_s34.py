"""The generated tables of session 34's work on the AMD machine (2026-12-05): bf16 queries
over int8 pages in integer products (csrc/paged_attention_int8.h), a decode row's attention
and a prefill's against the kernel before it, and session 32's long-context command run again
with that kernel; summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

from collections.abc import Callable

from summary_tables_s30 import long_context_run_tables
from summary_tables_s33 import table_quant_decode_blocks

INT8_DECODE = "bench_decode_attention_s34.json"
INT8_PREFILL = "bench_decode_attention_s34_prefill.json"
LONG_CONTEXT = "bench_long_context_s34.json"

TABLES: dict[str, Callable[[], str]] = {
    "int8_integer_decode_s34": lambda: table_quant_decode_blocks(INT8_DECODE),
    "int8_integer_prefill_s34": lambda: table_quant_decode_blocks(INT8_PREFILL),
    **long_context_run_tables("_s34", LONG_CONTEXT),
}
