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
a table function to ``summary_tables.TABLES`` (or a figure to ``results_data.figures()``),
and the markers to the page.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent))  # results_data, summary_tables

from results_data import PAGES, ROOT, Figure, figures, index, load, spread  # noqa: E402
from summary_tables import TABLES  # noqa: E402

__all__ = ["PAGES", "TABLES", "Figure", "figures", "index", "load", "render", "spread", "stale"]

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
