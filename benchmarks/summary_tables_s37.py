"""The generated tables of session 37's measurements on the AMD machine (2026-12-06), with
int4 KV read by the CPU kernel: a decode row's attention per layer against a bare cold read
of its own pages for bf16, int8, int4 and fp8 pages, the one command of issue 44's runs
with int4 KV in it, and each KV dtype's accuracy against the unquantized pool on the kernel
and on the torch path; summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from results_data import load
from summary_tables_s22 import _head, _row
from summary_tables_s27 import table_long_context_kv_dtypes
from summary_tables_s30 import long_context_run_tables
from summary_tables_s36 import table_decode_floors

DECODE_FLOORS = "bench_decode_attention_s37.json"
LONG_CONTEXT = "bench_long_context_s37.json"  # session 32's command, int4 KV added
# bench_long_context.py's defaults (1,000 to 8,000 tokens, every KV dtype, both peers).
LONG_CONTEXT_B = "bench_long_context_s37b.json"
LONG_CONTEXT_C = "bench_long_context_s37c.json"  # session 32's command with int4 once more
# bench_kv_quant_accuracy.py --dtype bfloat16, the C++ kernels on, and off (the torch path).
ACCURACY = ("kv_quant_accuracy_s37_kernel.json", "kv_quant_accuracy_s37_torch.json")


def table_kv_quant_accuracy(names: tuple[str, str] = ACCURACY) -> str:
    """Per KV dtype, against the unquantized pool of the same run (SmolLM2, bf16, teacher-forced
    over the prompts and the unquantized greedy answers): mean KL, top-1 agreement, the
    prompts' perplexity change and the free-running greedy answers' agreeing prefix, on the
    C++ kernel and on the torch path (each cell: kernel / torch)."""
    kernel, torch_path = ({r["kv_dtype"]: r for r in load(n)["results"]} for n in names)
    out = _head(
        "KV dtype",
        "bytes a token",
        "mean KL",
        "top-1 agreement",
        "perplexity change",
        "greedy answers' agreeing prefix",
        align="lrrrrr",
    )
    for kv, a in kernel.items():
        if kv == "auto":
            continue
        b = torch_path[kv]
        out.append(
            _row(
                kv,
                a["kv_bytes_per_token"],
                f"{a['mean_kl']:.4f} / {b['mean_kl']:.4f}",
                f"{100 * a['top1_agreement']:.1f}% / {100 * b['top1_agreement']:.1f}%",
                f"{a['ppl_change_pct']:+.1f}% / {b['ppl_change_pct']:+.1f}%",
                f"{100 * a['greedy_agree_prefix_frac']:.0f}% / "
                f"{100 * b['greedy_agree_prefix_frac']:.0f}%",
            )
        )
    return "\n".join(out)


TABLES: dict[str, Callable[[], str]] = {
    "decode_floors_s37": partial(table_decode_floors, DECODE_FLOORS),
    "kv_quant_accuracy_s37": table_kv_quant_accuracy,
    **long_context_run_tables("_s37", LONG_CONTEXT),
    **long_context_run_tables("_s37b", LONG_CONTEXT_B),
    # Their KV dtypes' tables with int4 in them.
    **{
        f"long_context_kv_dtypes{suffix}": partial(
            table_long_context_kv_dtypes, name, ("int8", "int4", "fp8_e4m3")
        )
        for suffix, name in (("_s37", LONG_CONTEXT), ("_s37b", LONG_CONTEXT_B))
    },
    # The command's second run: its per-cell and floors' tables (its ratios are figures).
    **{
        key: table
        for key, table in long_context_run_tables("_s37c", LONG_CONTEXT_C).items()
        if key in ("long_context_s37c", "long_context_paged_floor_s37c")
    },
}
