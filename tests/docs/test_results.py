"""Every figure a reader sees is the plain result of committed JSON (benchmarks/summary.py).

- each figure marker in README.md, docs/ and benchmarks/README.md names result files that
  exist, and the text just before it is what ``summary.py`` computes from them now;
- each generated table equals what ``summary.py`` renders from the JSON;
- ``benchmarks/results/`` holds nothing the pages do not use, and ``index.json`` gives every
  file its command, date, commit and machine (the commit the one git says added it);
- no measured-looking figure (a ratio, tok/s, GB/s, time per token, "% less/more") stands in
  prose without a marker: outside code blocks and generated tables, each such line carries
  one, or is a computed (not measured) quantity listed below.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import bench_modules
import pytest

summary = bench_modules.load("summary.py", "bench_summary")
REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
PAGES = [REPO / p for p in summary.PAGES]

# A figure that looks measured: a ratio (1.22x, 0.9×; not a product "4 × 2"), a rate, a time
# per token, a relative time.
MEASURED = re.compile(
    r"\b\d+(\.\d+)?([-–]\d+(\.\d+)?)?(x\b|×)(?!\d)|\d ?tok/s|\d ?GB/s|ms (a|per) (token|step)"
    r"|\d ?% (less|more|faster|slower)"
)
# Targets ("target ≤ 1.2x", "(target 0.9x)") are not measurements.
TARGET = re.compile(r"(target )?(≤ )?\d+(\.\d+)?x(?=\)| its| on| a second)|target \d+(\.\d+)?x")
# Computed quantities (bytes of a page per dtype), not measurements.
NOT_MEASURED = (
    "the pages per GiB",
    "fp8_e4m3 4x)",
    "16×head_dim",
    "bytes per parameter",
    "the tokens of a 16-bit pool",
    "page lists 16× longer",
    "8× less than",
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_page_agrees_with_the_json(page: Path) -> None:
    problems = summary.stale(str(page.relative_to(REPO)), page.read_text())
    assert not problems, "\n".join(problems)


def test_figures_name_files_that_exist_and_are_indexed() -> None:
    index = summary.index()
    for name, fig in summary.figures().items():
        assert fig.files, name
        for f in fig.files:
            assert (RESULTS / f).is_file(), f"{name}: {f} is not in benchmarks/results"
            assert f in index, f"{name}: {f} has no entry in results/index.json"


def test_every_marker_is_on_a_page() -> None:
    """No figure computed for nobody, and every table's markers are somewhere."""
    text = "\n".join(p.read_text() for p in PAGES)
    used = {m.group(1) for m in summary.FIGURE_RE.finditer(text)}
    assert used == set(summary.figures()), set(summary.figures()) ^ used
    for table in summary.TABLES:
        assert f"<!-- table:{table} -->" in text, f"table {table} is on no page"


def test_spread_counts_every_run() -> None:
    assert summary.spread([1.28, 1.271, 1.152, 1.236, 1.203, 1.237, 1.183, 1.174]) == (
        "median 1.22x (1.15-1.28x, 8 runs)"
    )
    assert summary.spread([2.0]) == "2.00x (1 run)"


def test_results_hold_only_what_the_pages_use() -> None:
    index = summary.index()
    text = "\n".join(p.read_text() for p in PAGES)
    tables = {m.group(2) for m in summary.TABLE_RE.finditer(text)}
    rendered = "\n".join(summary.TABLES[t]() for t in tables if t != "index")
    figure_files = {f for fig in summary.figures().values() for f in fig.files}
    for path in sorted(RESULTS.iterdir()):
        name = path.name
        if name == "index.json":
            continue
        assert path.is_file(), f"benchmarks/results/{name}: only result files belong here"
        if name.endswith(".json"):
            assert name in index, f"{name}: not in results/index.json"
            used = name in figure_files or name in rendered or f"results/{name}" in text
            assert used, f"{name}: no page quotes it (delete it, or quote it)"
        else:
            assert f"results/{name}" in text, f"{name}: no page shows it"
    for name in index:
        assert (RESULTS / name).is_file(), f"results/index.json names {name}, which is gone"


def test_index_entries_are_complete_and_match_git() -> None:
    index = summary.index()
    inside_git = (
        subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--is-inside-work-tree"], capture_output=True
        ).returncode
        == 0
    )
    for name, entry in index.items():
        for key in ("command", "date", "commit", "cpu", "date_source"):
            assert entry.get(key), f"{name}: index entry lacks {key}"
        assert entry["command"].startswith("python benchmarks/"), name
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", entry["date"]), name
        if not inside_git:
            continue
        log = subprocess.run(
            [
                "git",
                "-C",
                str(REPO),
                "log",
                "--diff-filter=A",
                "--format=%h",
                "--",
                f"benchmarks/results/{name}",
            ],
            capture_output=True,
            text=True,
        ).stdout.split()
        if log:  # a file added on this branch and not yet committed has no history yet
            assert log[-1].startswith(entry["commit"]) or entry["commit"].startswith(log[-1]), name


def _prose_lines(text: str) -> list[tuple[int, str]]:
    out, fence, table = [], False, False
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if line.startswith(("<!-- table:", "<!-- cli-reference -->")):  # generated blocks
            table = True
        elif line.startswith(("<!-- /table:", "<!-- /cli-reference -->")):
            table = False
        elif not fence and not table:
            out.append((i, line))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_unmarked_measured_figure(page: Path) -> None:
    bad = [
        f"{page.relative_to(REPO)}:{i}: {line.strip()}"
        for i, line in _prose_lines(page.read_text())
        if MEASURED.search(TARGET.sub("", line))
        and "<!-- figure:" not in line
        and not any(s in line for s in NOT_MEASURED)
    ]
    assert not bad, "measured figures without a result marker:\n" + "\n".join(bad)


def test_results_page_stays_short() -> None:
    assert len((REPO / "benchmarks" / "README.md").read_text().splitlines()) <= 400


def test_long_context_page_stays_short() -> None:
    """long_context.md says where the targets stand, what holds them and the latest
    runs; every earlier run goes to long_context_history.md rather than growing it again."""
    assert len((REPO / "benchmarks" / "long_context.md").read_text().splitlines()) <= 450
