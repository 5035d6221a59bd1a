"""The generated tables of session 30's work on the AMD machine (2026-12-05): the CPU
attention's softmax exponential and rescaling made cheaper for a prefill, and a decode
step's attention set against a bare cold read of its own pages (``--read-floor``, and the
paged read floor of ``bench_long_context.py``);
summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from results_data import load
from summary_tables_s22 import _head, _row
from summary_tables_s23 import long_context_tables
from summary_tables_s27 import table_decode_attention_stream, table_long_context_kv_dtypes

PREFILL_ATTENTION = "bench_decode_attention_s30_prefill.json"
DECODE_ATTENTION = "bench_decode_attention_s30.json"
LONG_CONTEXT = "bench_long_context_s30.json"
LONG_CONTEXT_B = "bench_long_context_s30b.json"


def table_decode_read_floor(name: str = DECODE_ATTENTION) -> str:
    """bench_decode_attention.py --read-floor: per context, a decode row's attention per layer
    from memory (cold), the baseline kernel's beside it, a bare cold read of the same pages
    (``read cold``) and the kernel's time over the read's; then from the shortest context to
    the longest the growth of each (medians of the run)."""
    d = load(name)
    rows, base = d["results"], d["baseline"]
    out = _head(
        "context",
        "attention cold, us per layer",
        f"at {base}",
        "pages read cold, us per layer",
        "attention over the read",
        align="rrrrr",
    )
    for r in rows:
        us = r["us_per_layer"]
        out.append(
            _row(
                r["context"],
                f"{us['current cold']:.0f}",
                f"{us[f'{base} cold']:.0f}",
                f"{us['read cold']:.0f}",
                f"{us['current cold'] / us['read cold']:.2f}",
            )
        )
    lo, hi = rows[0]["us_per_layer"], rows[-1]["us_per_layer"]

    def growth(key: str) -> float:
        return hi[key] - lo[key]

    out.append(
        _row(
            f"growth {rows[0]['context']} to {rows[-1]['context']}",
            f"{growth('current cold'):.0f}",
            f"{growth(f'{base} cold'):.0f}",
            f"{growth('read cold'):.0f}",
            f"{growth('current cold') / growth('read cold'):.2f}",
        )
    )
    return "\n".join(out)


def table_long_context_paged_floor(name: str = LONG_CONTEXT) -> str:
    """bench_long_context.py's floors for a decode token's bf16 KV, repetition by repetition:
    the sequential read rate sampled and the KV read floor it gives, beside the paged read
    floors (the same KV read cold on pages scattered at random and, where the run sampled
    it, in ascending order); then the bf16 server's TPOT growth from the shortest context to
    the longest over each floor's growth (the run's medians)."""
    d = load(name)
    ctxs = sorted({f["context"] for f in d["floors"]})
    lo, hi = ctxs[0], ctxs[-1]
    paged = [("scattered", "paged_kv_floor_ms")]
    if all("contiguous_kv_floor_ms" in f for f in d["floors"]):
        paged.append(("ascending", "contiguous_kv_floor_ms"))
    names = ["repetition", "read GB/s sampled", f"sequential KV floor, ms at {lo}", f"at {hi}"]
    for label, _ in paged:
        names += [f"{label} pages' floor, ms at {lo}", f"at {hi}"]
    out = _head(*names, align="r" * len(names))
    floors = {(f["rep"], f["context"]): f for f in d["floors"]}
    for rep in sorted({r for r, _ in floors}):
        short, long = floors[(rep, lo)], floors[(rep, hi)]
        cells = [rep, f"{short['read_gbs']:.1f}"]
        cells += [f"{short['kv_floor_ms']['auto']:.2f}", f"{long['kv_floor_ms']['auto']:.2f}"]
        for _, key in paged:
            cells += [f"{short[key]:.2f}", f"{long[key]:.2f}"]
        out.append(_row(*cells))
    g = d["growth"]["radixserve-bf16"]
    names = ["radixserve-bf16, ms a token", "TPOT growth", "sequential floor's growth"]
    names += ["over it (target <= 1.5)"]
    cells = [f"{lo} to {hi} (medians)", f"{g['tpot_ms']:.1f}", f"{g['kv_floor_ms']:.1f}"]
    cells += [f"{g['tpot_ms_over_kv_floor']:.2f}"]
    for label, key in paged:
        names += [f"{label} pages' floor's growth", "over it"]
        cells += [f"{g[key]:.1f}", f"{g['tpot_ms_over_' + key.removesuffix('_ms')]:.2f}"]
    out += ["", *_head(*names, align="l" + "r" * (len(names) - 1)), _row(*cells)]
    return "\n".join(out)


def long_context_run_tables(suffix: str, name: str) -> dict[str, Callable[[], str]]:
    """A bench_long_context run's four tables for summary_tables.TABLES, keyed
    ``long_context{suffix}`` (per cell), ``..._targets``, ``long_context_kv_dtypes{suffix}``
    and ``long_context_paged_floor{suffix}``."""
    return {
        **long_context_tables(f"long_context{suffix}", name),
        f"long_context_kv_dtypes{suffix}": partial(table_long_context_kv_dtypes, name),
        f"long_context_paged_floor{suffix}": partial(table_long_context_paged_floor, name),
    }


TABLES: dict[str, Callable[[], str]] = {
    "prefill_attention_s30": partial(table_decode_attention_stream, PREFILL_ATTENTION),
    "decode_read_floor_s30": table_decode_read_floor,
    **long_context_tables("long_context_s30", LONG_CONTEXT),
    "long_context_kv_dtypes_s30": partial(table_long_context_kv_dtypes, LONG_CONTEXT),
    "long_context_paged_floor_s30": table_long_context_paged_floor,
    **long_context_run_tables("_s30b", LONG_CONTEXT_B),
}
