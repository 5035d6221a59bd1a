"""The generated tables of the second GPU run (benchmarks/gpu_check.sh on one H200,
2026-12-04, one invocation: gpu_check_s26.json), beside the first run's where a figure
is measured in both; summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

from typing import Any

from results_data import load
from summary_tables_s22 import _head, _row, table_speculative, table_speculative_concurrent
from summary_tables_s23 import table_long_context, table_long_context_targets
from summary_tables_s24 import GPU_CHECK, table_gpu_check, table_gpu_serving

SECOND = ("gpu_check_s26.json",)
#: The invocation of each run that measured the kernels, decode steps and serving.
RUNS = (("first", GPU_CHECK[0]), ("second", SECOND[0]))


def _phase(name: str, phase: str) -> dict[str, Any]:
    record: dict[str, Any] = load(name)["phases"][phase]
    return record


def table_gpu_check_s26() -> str:
    """Every phase of the second run: status, measured and estimated seconds."""
    return table_gpu_check(SECOND)


def table_gpu_serving_s26() -> str:
    """The second run's shared-system (in process) and HTTP serving rows."""
    return table_gpu_serving(SECOND)


def table_gpu_decode_kernel_runs() -> str:
    """The paged decode kernel (batch 64 x 4096 context, page 16, fp16 queries) in both runs:
    its fraction of each run's copy bandwidth at the default and at the best split count."""
    out = _head(
        "shape", "KV dtype", "run", "default splits: µs", "of copy bandwidth",
        "best splits: µs", "of copy bandwidth", align="lllrrrr",
    )  # fmt: skip
    cells = {
        run: {(c["shape"], c["kv_dtype"]): c for c in _phase(name, "decode_bandwidth")["decode"]}
        for run, name in RUNS
    }
    for key in cells["first"]:
        for run, _ in RUNS:
            c = cells[run][key]
            out.append(
                _row(
                    key[0],
                    key[1],
                    run,
                    f"{c['ms_default'] * 1e3:.1f}",
                    f"{c['frac_copy_bw_default']:.1%}",
                    f"{c['ms_best'] * 1e3:.1f}",
                    f"{c['frac_copy_bw_best']:.1%}",
                )
            )
    copy = ", ".join(
        f"{run} {_phase(name, 'decode_bandwidth')['copy_bandwidth_gbps']:.0f} GB/s"
        for run, name in RUNS
    )
    return "\n".join([*out, "", f"Copy bandwidth (reads plus writes, 2 GiB): {copy}."])


def table_gpu_decode_steps_runs() -> str:
    """Decode steps of the SmolLM2-shaped model (bf16, Triton): the CUDA-graph speed-up over
    eager in each run, and the graphed step's time."""
    out = _head(
        "batch", "context", "graphed ms, first", "graphed ms, second",
        "graph speed-up, first", "graph speed-up, second", align="rrrrrr",
    )  # fmt: skip
    rows = [_phase(name, "decode_table")["rows"] for _, name in RUNS]
    for a, b in zip(*rows, strict=True):
        out.append(
            _row(
                a["batch"],
                a["context"],
                f"{a['graph_ms']:.2f}",
                f"{b['graph_ms']:.2f}",
                f"{a['graph_speedup']:.1f}",
                f"{b['graph_speedup']:.1f}",
            )
        )
    return "\n".join(out)


LONG_CONTEXT_QUIET = "bench_long_context_s26.json"


def table_long_context_quiet() -> str:
    """bench_long_context.py --in-process on the AMD machine with nothing else running: the
    server through HTTP beside the same engine in the benchmark's process (table_long_context)."""
    return table_long_context(LONG_CONTEXT_QUIET)


def table_long_context_quiet_targets() -> str:
    """The same run against the targets (no vLLM in it: its TTFT column is n/a)."""
    return table_long_context_targets(LONG_CONTEXT_QUIET)


GEMV_ROWS = "bench_gemv_rows_s26.json"


def table_gemv_rows(name: str = GEMV_ROWS) -> str:
    """bench_gemv_rows.py: every bf16 linear of the default model (30 layers and the head,
    weights on huge pages) through the GEMV kernel at each row count, against the build of
    the commit named in its args, passes alternating (its args: threads and clock)."""
    d = load(name)
    rev = d["args"]["rev"]
    out = _head(
        "rows", "ms a pass, now", f"ms a pass, {rev}", "now / before", "now over the read floor",
        f"{rev} over the read floor", align="rrrrrr",
    )  # fmt: skip
    for r in d["kernel"]:
        out.append(
            _row(
                r["rows"],
                f"{r['tree_ms']:.2f}",
                f"{r['rev_ms']:.2f}",
                f"{r['ratio']:.2f}",
                f"{r['tree_ms'] / r['floor_ms']:.2f}",
                f"{r['rev_ms'] / r['floor_ms']:.2f}",
            )
        )
    return "\n".join(out)


def table_gemv_stack() -> str:
    """The same run's decoder stack (every layer in one call, every linear on GEMV as a
    verify step keeps them): decode steps of 1 and of 9 requests."""
    d = load(GEMV_ROWS)
    rev = d["args"]["rev"]
    out = _head("rows", "ms a step, now", f"ms a step, {rev}", "now / before", align="rrrr")
    for r in d["stack"]:
        out.append(
            _row(r["rows"], f"{r['tree_ms']:.2f}", f"{r['rev_ms']:.2f}", f"{r['ratio']:.2f}")
        )
    one = {r["rows"]: r for r in d["stack"]}
    out += [
        "",
        f"9 rows over 1 row: now {one[9]['tree_ms'] / one[1]['tree_ms']:.2f}x, {rev} "
        f"{one[9]['rev_ms'] / one[1]['rev_ms']:.2f}x.",
    ]
    return "\n".join(out)


SPECULATIVE_AMD = "bench_speculative_s26.json"


def table_speculative_amd() -> str:
    """bench_speculative.py on the AMD machine after the GEMV's multi-row change
    (table_speculative)."""
    return table_speculative(SPECULATIVE_AMD)


def table_speculative_concurrent_amd() -> str:
    """The same run's 16-at-a-time phase (table_speculative_concurrent)."""
    return table_speculative_concurrent(SPECULATIVE_AMD)
