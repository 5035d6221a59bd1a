"""No file of the project carries a merge's conflict markers.

A conflict resolved by committing both sides leaves ``<<<<<<<`` / ``>>>>>>>`` lines that
Markdown renders as text and no other test notices (a table row doubled, both versions shown).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("radixserve", "kernels", "frontend_dsl", "tests", "benchmarks", "docs", ".ci")
SUFFIXES = {".py", ".md", ".toml", ".sh", ".cpp", ".h", ".yaml", ".yml", ".txt", ".cfg"}
# A marker line: seven of <, > or = at the start, then the end of the line or a space and a name.
MARKER = re.compile(r"^(<{7}|>{7})( .*)?$|^={7}$", re.MULTILINE)


def _project_files() -> list[Path]:
    files = [p for p in ROOT.iterdir() if p.is_file() and p.suffix in SUFFIXES]
    for top in TOP:
        files += [p for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    return [p for p in files if "__pycache__" not in p.parts and "results" not in p.parts]


def test_no_conflict_markers() -> None:
    files = _project_files()
    assert any(p.name == "README.md" for p in files)  # the walk sees the project
    hits = [
        f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
        for p in files
        for text in [p.read_text(errors="replace")]
        for m in MARKER.finditer(text)
    ]
    assert not hits, f"merge conflict markers left in: {hits}"
