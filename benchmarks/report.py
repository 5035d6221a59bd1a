"""benchmarks/README.md's performance tables and plots from ``bench_peers.py``'s JSON.

    python benchmarks/report.py                       # every benchmarks/results/peers_*.json
    python benchmarks/report.py benchmarks/results/peers_shared_system.json --out-dir benchmarks/results

Writes, next to the JSON: ``peers_report.md`` (one Markdown table per workload: output
and total tok/s, TTFT and ITL p50/p90, hit rate against the optimum, peak RSS, per peer
and concurrency; the median over repetitions; plus ratios against radixserve) and PNG
plots per workload: ``<stem>_throughput.png`` and ``<stem>_ttft.png`` (against
concurrency, one line per peer) and ``<stem>_hit.png`` (measured hit rate against the
optimum, per peer that reports it).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

MEDIAN_KEYS = (
    "output_tok_per_s",
    "total_tok_per_s",
    "hit_rate",
    "optimal_hit_rate_page16",
    "optimal_hit_rate_peer",
    "page_size",
    "peak_rss_bytes",
    "errors",
    "wall_s",
    "load_avg_before",
)


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def aggregate(doc: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """peer -> concurrency -> metrics (medians over repetitions; cells with errors only are kept as errors)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for cell in doc["cells"]:
        groups[(cell["peer"], cell["concurrency"])].append(cell)
    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for (peer, c), cells in groups.items():
        ok = [x for x in cells if "output_tok_per_s" in x]
        if not ok:
            out[peer][c] = {
                "error": cells[-1].get("error", "failed"),
                "label": cells[-1].get("label", peer),
            }
            continue
        agg: dict[str, Any] = {
            "label": ok[0]["label"],
            "precision": ok[0]["precision"],
            "reps": len(ok),
            "offline": bool(ok[0].get("offline")),
        }
        for k in MEDIAN_KEYS:
            agg[k] = _median([x.get(k) for x in ok])
        for k in ("ttft_ms", "itl_ms", "tpot_ms"):
            agg[k] = {q: _median([x[k][q] for x in ok]) for q in ("p50", "p90", "p99")}
        agg["output_tok_per_s_all"] = [x["output_tok_per_s"] for x in ok]
        agg["requests"] = ok[0]["requests"]
        out[peer][c] = agg
    return out


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def markdown(doc: dict[str, Any], agg: dict[str, dict[int, dict[str, Any]]]) -> str:
    w = doc["workload"]
    a = doc.get("args", {})
    tag = a.get("tag") or ""
    lines = [f"### Workload `{w}`" + (f" (run `{tag}`)" if tag else ""), ""]
    cmd = (
        f"python benchmarks/bench_peers.py --workload {w} --concurrency "
        f"{a.get('concurrency')} --scale {a.get('scale')}"
    )
    if a.get("reps", 1) != 1:
        cmd += f" --reps {a['reps']}"
    if a.get("peers"):
        cmd += f" --peers {a['peers']}"
    for pc in a.get("peer_concurrency") or []:
        cmd += f" --peer-concurrency {pc}"
    if tag:
        cmd += f" --tag {tag}"
    lines.append(
        f"`{cmd}` — {doc['date']}, {doc['machine']['cores']} cores, load average at start "
        f"{doc['machine']['load_avg_at_start'][0]:.1f}; KV budget {a.get('kv_gib')} GiB per peer; medians over "
        f"repetitions. `load`: the 1-minute load average before the cell (2 cores; above ~2 other work shared "
        "the CPU)."
    )
    lines.append("")
    lines.append(
        "| peer | prec | conc | reqs | out tok/s | total tok/s | TTFT p50 / p90 (ms) | ITL p50 / p90 (ms) "
        "| hit rate (optimum @page) | peak RSS (GiB) | load |"
    )
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for by_c in agg.values():
        for c in sorted(by_c):
            m = by_c[c]
            if "error" in m:
                lines.append(f"| {m['label']} | | {c} | | error: {m['error'][:80]} | | | | | | |")
                continue
            hit = (
                f"{_f(m['hit_rate'], '{:.3f}')} ({_f(m['optimal_hit_rate_peer'], '{:.3f}')} "
                f"@{_f(m['page_size'], '{:.0f}')})"
            )
            offline = " (offline)" if m["offline"] else ""
            lines.append(
                f"| {m['label']}{offline} | {m['precision']} | {c} | {m['requests']} | {_f(m['output_tok_per_s'])} | "
                f"{_f(m['total_tok_per_s'], '{:.0f}')} | {_f(m['ttft_ms']['p50'], '{:.0f}')} / "
                f"{_f(m['ttft_ms']['p90'], '{:.0f}')} | {_f(m['itl_ms']['p50'])} / {_f(m['itl_ms']['p90'])} | {hit} | "
                f"{_f((m['peak_rss_bytes'] or 0) / 2**30, '{:.2f}')} | {_f(m['load_avg_before'])} |"
            )
    ratio_lines = []
    # radixserve (fp32) against every peer; radixserve bf16 against the bf16 peers (same precision).
    for base_name in ("radixserve", "radixserve-bf16"):
        base = agg.get(base_name, {})
        base_prec = "bf16" if base_name.endswith("bf16") else None
        for peer, by_c in agg.items():
            if peer.startswith("radixserve") and peer != "radixserve-nocache":
                continue
            for c in sorted(by_c):
                m, b = by_c[c], base.get(c)
                if b is None or "error" in m or "error" in b or not m.get("output_tok_per_s"):
                    continue
                if base_prec and m.get("precision") != base_prec:
                    continue
                ttft = (
                    f", TTFT p90 {b['ttft_ms']['p90'] / m['ttft_ms']['p90']:.2f}x of {peer}'s"
                    if m["ttft_ms"]["p90"]
                    else ""
                )
                ratio_lines.append(
                    f"- c={c}: {base_name} / {peer} output throughput "
                    f"**{b['output_tok_per_s'] / m['output_tok_per_s']:.2f}x**{ttft}"
                )
    if ratio_lines:
        lines += [
            "",
            "Ratios (radixserve with the radix cache against each peer, same concurrency; "
            "TTFT: radixserve's p90 over the peer's):",
            "",
            *ratio_lines,
        ]
    if doc.get("failures"):
        lines += ["", "Peers that failed:", ""]
        lines += [f"- {p}: {'; '.join(sorted(set(m)))}" for p, m in doc["failures"].items()]
    if doc.get("probes"):
        lines += [
            "",
            'Greedy probe answers ("What is the capital of France? Answer in one sentence."):',
            "",
        ]
        lines += [f"- {p}: {v['text']!r}" for p, v in doc["probes"].items()]
    lines.append("")
    return "\n".join(lines)


_SPECIAL = re.compile(r"<\|(?:im_start|im_end|endoftext)\|>")


def _norm(text: str) -> str:
    """Output text without ChatML special tokens (servers skip them when detokenizing; an
    offline decode may keep them), so the comparison is on the tokens that carry text."""
    return _SPECIAL.sub("", text)


def agreement(
    raw: dict[str, list[dict[str, Any]]], ref: str = "radixserve"
) -> dict[str, tuple[int, int, int]]:
    """peer -> (requests with output identical to ``ref``'s, identical first 16 characters, compared) over
    the cells both ran (same repetition and concurrency: same token ids; greedy)."""
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for key, recs in raw.items():
        peer, c, rep = key.split("/")
        if peer == ref or f"{ref}/{c}/{rep}" not in raw:
            continue
        for a, b in zip(recs, raw[f"{ref}/{c}/{rep}"]):
            if a.get("error") or b.get("error") or not a.get("text") or not b.get("text"):
                continue
            ta, tb = _norm(a["text"]), _norm(b["text"])
            out[peer][0] += (
                ta == tb or ta.startswith(tb) or tb.startswith(ta)
            )  # a peer may stop at EOS
            out[peer][1] += ta[:16] == tb[:16]
            out[peer][2] += 1
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def plots(doc: dict[str, Any], agg: dict[str, dict[int, dict[str, Any]]], stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for key, ylabel, fname, q in (
        ("output_tok_per_s", "output tokens/s", "throughput", None),
        ("ttft_ms", "TTFT p90 (ms)", "ttft", "p90"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for by_c in agg.values():
            cs = [c for c in sorted(by_c) if "error" not in by_c[c]]
            ys = [by_c[c][key][q] if q else by_c[c][key] for c in cs]
            if cs and all(y is not None for y in ys):
                ax.plot(cs, ys, marker="o", label=by_c[cs[0]]["label"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        if key == "ttft_ms":
            ax.set_yscale("log")
        ax.set_title(
            f"{doc['workload']}: {ylabel} vs concurrency\n(SmolLM2-135M, 2 CPU cores)", fontsize=10
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}_{fname}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path)
    # hit rate vs optimum: grouped bars per peer (those reporting), at each concurrency
    rows = [
        (peer, c, m)
        for peer, by_c in agg.items()
        for c, m in sorted(by_c.items())
        if "error" not in m and m.get("hit_rate") is not None
    ]
    if rows:
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4.5))
        xs = range(len(rows))
        ax.bar(
            [x - 0.2 for x in xs], [m["hit_rate"] for _, _, m in rows], width=0.4, label="measured"
        )
        ax.bar(
            [x + 0.2 for x in xs],
            [m["optimal_hit_rate_peer"] for _, _, m in rows],
            width=0.4,
            label="optimum (ideal unbounded cache at the peer's page/block size)",
            alpha=0.6,
        )
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{p}\nc={c}" for p, c, _ in rows], fontsize=7, rotation=30, ha="right")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("prompt-token hit rate")
        ax.set_title(f"{doc['workload']}: hit rate vs optimum")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}_hit.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path)
    return made


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "inputs",
        nargs="*",
        help="bench_peers JSON files (default: benchmarks/results/peers_*.json)",
    )
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    inputs = [Path(p) for p in args.inputs] or sorted(
        p for p in out_dir.glob("peers_*.json") if not p.name.endswith("_raw.json")
    )
    if not inputs:
        print("no bench_peers results found", file=sys.stderr)
        return 1
    sections = ["## Performance against peers", ""]
    for path in inputs:
        doc = json.loads(path.read_text())
        agg = aggregate(doc)
        sections.append(markdown(doc, agg))
        raw_path = path.with_name(path.stem + "_raw.json")
        if raw_path.exists() and doc["workload"] in ("shared_system", "few_shot"):
            agree = agreement(json.loads(raw_path.read_text()))
            if agree:
                sections.append(
                    "Greedy outputs identical to radixserve's on the same prompts (whole answer, or a "
                    "prefix of it where the peer stopped at EOS / first 16 characters):"
                )
                sections.append("")
                sections += [
                    f"- {peer}: {same}/{n} whole, {head}/{n} first 16 chars"
                    for peer, (same, head, n) in agree.items()
                ]
                sections.append("")
        if not args.no_plots:
            for png in plots(doc, agg, out_dir / path.stem):
                sections.append(f"![{png.stem}]({png.name})")
            sections.append("")
    md = out_dir / "peers_report.md"
    md.write_text("\n".join(sections))
    print("\n".join(sections))
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
