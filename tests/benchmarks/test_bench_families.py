"""``bench_families.py`` runs end to end on tiny shapes: every family built from transformers'
own classes, its decode step timed against the weight floor, the path it took named (and
whether the one-call stack served its forwards)."""

from __future__ import annotations

import json
from pathlib import Path

import bench_modules

bench_families = bench_modules.load("bench_families.py", "bench_families")


def test_smoke_run_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "families.json"
    argv = ["--smoke", "--families", "llama,qwen3,gemma3_text", "--workdir", str(tmp_path)]
    assert bench_families.main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert set(res) == {"llama", "qwen3", "gemma3_text"}
    for r in res.values():
        # Llama's layers, Qwen3's q/k norms, Gemma 3's sandwich norms and sliding layers: all
        # in the one-call stack, which served the forwards
        assert r["native_stack_reason"] is None and r["stack_served"]
        assert r["step_ms_median"] > 0 and r["floor_ratio_median"] > 1  # slower than reading
        assert r["weight_bytes"] > 0
    assert res["llama"]["step_over_llama"] == 1.0
