"""Every figure the README, docs/ and benchmarks/README.md quote, computed from benchmarks/results/*.json.

    python benchmarks/summary.py            # print every figure and table
    python benchmarks/summary.py --write    # rewrite the generated tables in the pages
    python benchmarks/summary.py --check    # exit 1 if a page's table or figure is stale

Why: a figure typed by hand drifts from what its command printed (a run left out, a best
run quoted as typical, two interfaces compared). Here each figure is a function of result
files, over *all* their repetitions (median and range); a page quotes it as
``TEXT <!-- figure:NAME results: a.json, b.json -->`` and holds each table between
``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``; tests/docs/test_results.py checks the
pages against this module. ``results/index.json`` names, for every result file, the command
that wrote it, the date, the commit that added it and the machine (from the JSON where it
says, else from git history; see its ``source`` fields).

A new benchmark section: add its JSON to ``results/``, an entry to ``results/index.json``,
a function to ``TABLES`` (or ``figures()``), and the markers to the page.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = (
    "README.md",
    "benchmarks/README.md",
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


def quant_ratio(name: str, num: str, den: str, key: str) -> float:
    """bench_quant.py: one run's tok/s ratio of two configs (each the median of the run's rounds)."""
    rows = {r["config"]: r for r in load(name)["results"]}
    return float(rows[num][key] / rows[den][key])


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
HICACHE = [
    "bench_hicache_1000.json",
    "bench_hicache_1000_quiet.json",
    "bench_hicache_1000_quiet_l1_l2.json",
]


def figures() -> dict[str, Figure]:
    """Every figure quoted in prose, by name."""
    figs: dict[str, Figure] = {}

    def add(name: str, text: str, files: Iterable[str]) -> None:
        figs[name] = Figure(text, tuple(files))

    add("floor_bf16", spread(serving_floor(S18_BF16)), S18_BF16)
    add("floor_bf16_slow", spread(serving_floor(S18_BF16_SLOW)), S18_BF16_SLOW)
    add("floor_fp32", spread(serving_floor(S18_FP32)), S18_FP32)
    add("floor_fp32_slow", spread(serving_floor(S18_FP32_SLOW)), S18_FP32_SLOW)
    s18c1 = "peers_shared_system_s18c1.json"
    add("vllm_fp32_itl", spread(itl_ratio(s18c1, "radixserve", "vllm-fp32")), [s18c1])
    add("vllm_bf16_itl", spread(itl_ratio(s18c1, "radixserve-bf16", "vllm-bf16")), [s18c1])
    s18c16 = "peers_shared_system_s18c16.json"
    ours, theirs = (
        peer_out_tok(s18c16, "radixserve-bf16", 16),
        peer_out_tok(s18c16, "vllm-bf16", 16),
    )
    add("c16_bf16_vs_vllm", spread(a / b for a, b in zip(ours, theirs, strict=True)), [s18c16])
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
    return figs


# --- tables ------------------------------------------------------------------------------


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
    """bench_peers.py's ``full`` run at c=16, medians over its repetitions (report.aggregate)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    doc = load("peers_shared_system_full.json")
    agg = report.aggregate(doc)
    out = _head(
        "server (c=16)",
        "precision",
        "output tok/s, per repetition",
        "TTFT p50 / p90 (median)",
        "prompt-cache hit rate (optimum)",
        align="lllrr",
    )
    for peer in doc["args"]["peers"].split(","):
        a = agg[peer].get(16)
        if a is None or "error" in a:
            continue
        hit = (
            "0" if not a["hit_rate"] else f"{a['hit_rate']:.3f} ({a['optimal_hit_rate_peer']:.3f})"
        )
        ttft = f"{a['ttft_ms']['p50'] / 1000:.2f} / {a['ttft_ms']['p90'] / 1000:.2f} s"
        out.append(
            _row(a["label"], a["precision"], _list(a["output_tok_per_s_all"], "{:.1f}"), ttft, hit)
        )
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


def table_index() -> str:
    out = _head("result file", "command", "date", "commit", "machine", align="lllll")
    for name, e in sorted(index().items()):
        out.append(
            _row(name, f"`{e['command']}`", e["date"][:16].replace("T", " "), e["commit"], e["cpu"])
        )
    return "\n".join(out)


TABLES: dict[str, Callable[[], str]] = {
    "headline": table_headline,
    "floor": table_floor,
    "peers_c1": table_peers_c1,
    "llamacpp_f32": table_llamacpp_f32,
    "quant": table_quant,
    "hicache": table_hicache,
    "index": table_index,
}

TABLE_RE = re.compile(r"(<!-- table:(\w+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)
FIGURE_RE = re.compile(r"<!-- figure:(\w+) results: ([^>]*?) -->")


def render(text: str) -> str:
    """The page with every generated table replaced by what the JSON gives now."""
    return TABLE_RE.sub(lambda m: m.group(1) + TABLES[m.group(2)]() + "\n" + m.group(4), text)


def stale(page: str, text: str) -> list[str]:
    """What in one page disagrees with the JSON: tables, figure texts and their result files."""
    problems = []
    if render(text) != text:
        problems.append(
            f"{page}: a generated table is stale (python benchmarks/summary.py --write)"
        )
    figs = figures()
    for m in FIGURE_RE.finditer(text):
        name, files = m.group(1), tuple(f.strip() for f in m.group(2).split(","))
        fig = figs.get(name)
        if fig is None:
            problems.append(f"{page}: unknown figure {name}")
            continue
        if files != fig.files:
            problems.append(f"{page}: figure {name} names {files}, computed from {fig.files}")
        if not text[: m.start()].rstrip().endswith(fig.text):
            problems.append(
                f"{page}: figure {name} should read {fig.text!r} just before its marker"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--write", action="store_true", help="rewrite the generated tables in the pages"
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if a page disagrees with the JSON")
    args = ap.parse_args(argv)
    if args.write or args.check:
        problems = []
        for page in PAGES:
            path = ROOT / page
            text = path.read_text()
            if args.write and render(text) != text:
                path.write_text(render(text))
                text = path.read_text()
            problems += stale(page, text)
        print("\n".join(problems) or "every table and figure matches benchmarks/results")
        return 1 if problems else 0
    for name, fig in figures().items():
        print(f"{name}: {fig.text}  [{', '.join(fig.files)}]")
    for name, fn in TABLES.items():
        print(f"\n{name}:\n{fn()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
