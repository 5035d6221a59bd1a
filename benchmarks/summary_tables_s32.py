"""The generated tables of session 32's long-context runs on the AMD machine (2026-12-05):
the same command as session 31's, with the servers not being measured paused, and a run
that left them running, for comparison; summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from results_data import load
from summary_tables_s22 import _head, _row
from summary_tables_s23 import long_context_tables
from summary_tables_s27 import table_long_context_kv_dtypes
from summary_tables_s30 import long_context_run_tables

PAUSED = "bench_long_context_s32.json"
RUNNING = "bench_long_context_s32_running.json"


def table_idle_cpu(*names: str) -> str:
    """Per run and server: the CPU time its process tree used while idle, as a share of one
    core, over the 10 s the run sampled it with every server up and none asked anything
    (``bench_long_context.idle_cpu_share``), and whether the run paused the idle servers."""
    out = _head("run", "idle servers", "server", "idle CPU, share of a core", align="lllr")
    for name in names:
        d = load(name)
        how = "left running" if d["args"]["keep_idle_running"] else "paused"
        for server, share in sorted(d["idle_cpu_share"].items()):
            out.append(_row(name.removesuffix(".json"), how, server, f"{100 * share:.1f} %"))
    return "\n".join(out)


TABLES: dict[str, Callable[[], str]] = {
    "long_context_idle_cpu_s32": partial(table_idle_cpu, PAUSED, RUNNING),
    **long_context_run_tables("_s32", PAUSED),
    **long_context_tables("long_context_s32_running", RUNNING),
    "long_context_kv_dtypes_s32_running": partial(table_long_context_kv_dtypes, RUNNING),
}
