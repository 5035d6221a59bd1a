"""``bench_window.py``: its pool arithmetic, and its quick mode end to end (a Gemma-3-shaped
model with its window pool against its window-disabled twin under the same KV bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import bench_modules
import pytest

bench_window = bench_modules.load("bench_window.py", "bench_window")


def test_pool_allows_arithmetic() -> None:
    """Full KV: N // pages(seq); windowed: the global pages or the window pages (window +
    chunk + a page), whichever runs out first."""
    args = bench_window.parse_args(["--window", "32", "--chunk", "64", "--page-size", "4"])
    # 266 tokens: 67 pages each; window pages min(266, 96) / 4 + 1 = 25 each.
    assert bench_window.pool_allows(400, (684, 342), 266, args) == {"full": 5, "window": 10}
    assert bench_window.pool_allows(400, (684, 100), 266, args)["window"] == 4
    assert bench_window.pool_allows(400, (684, 342), 20, args)["window"] == 57  # 6 each


@pytest.mark.slow  # ~20 s alone, more on a loaded machine: two engines and a cold rerun
def test_quick_run_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "window.json"
    small = ["--requests", "4", "--system-tokens", "100", "--hold-tokens", "24"]
    argv = ["--quick", *small, "--workdir", str(tmp_path), "--out", str(out)]
    assert bench_window.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "bench_window" and r["commit"] and r["machine"]["cores"]
    assert r["window_layers"] == [0, 1, 2, 3, 4]  # 5:1
    pools = r["pools"]
    assert pools["full"]["nbytes"] == r["budget"]["kv_bytes"]
    # The same bytes, split (pages rounded down; each pool has a scratch page).
    assert pools["window"]["nbytes"] == pytest.approx(pools["full"]["nbytes"], rel=0.01)
    assert pools["window"]["pages"] > pools["full"]["pages"]  # the same bytes, more pages
    assert r["pool_allows"]["window"] > r["pool_allows"]["full"]
    mem = r["radixserve_memory"]
    assert mem["sequences_window"] > mem["sequences_full"]
    shared, distinct = r["results"]["shared"], r["results"]["distinct"]
    # Same prefix structure, same pages: the window costs no hit on this workload.
    assert shared["window"]["hit_rate"] == shared["full"]["hit_rate"] > 0.4
    assert shared["window"]["window_cut_tokens"] == 0
    w = distinct["window"]
    assert w["peak_running"] >= distinct["full"]["peak_running"]
    # Window pages were freed as the requests moved on: fewer needed than global pages held.
    assert w["peak_window_pages_in_use"] < w["peak_pages_held_by_running"]
    assert r["hits_rerun_cold"] == {"checked": 2, "equal": 2}
