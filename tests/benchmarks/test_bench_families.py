"""``bench_families.py`` runs end to end on tiny shapes: every family built from transformers'
own classes, its decode step timed against the weight floor, the path it took named."""

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
    assert res["llama"]["native_stack_reason"] is None  # Llama's layers: the one-call stack
    assert res["qwen3"]["native_stack_reason"] is None  # its q/k norms run in the stack too
    assert "per-layer path" in res["gemma3_text"]["native_stack_reason"]
    for r in res.values():
        assert r["step_ms_median"] > 0 and r["floor_ratio_median"] > 1  # slower than reading
        assert r["weight_bytes"] > 0
    assert res["llama"]["step_over_llama"] == 1.0
