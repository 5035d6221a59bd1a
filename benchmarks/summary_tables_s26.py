"""The generated tables of the second GPU run (benchmarks/gpu_check.sh on one H200,
2026-12-04, one invocation: gpu_check_s26.json), beside the first run's where a figure
is measured in both; summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

from typing import Any

from results_data import load
from summary_tables_s22 import _head, _row
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
