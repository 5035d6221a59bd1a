"""benchmarks/gpu_check.sh parses, and its Python driver runs on the CPU in dry-run mode
(tiny shapes, torch backend; the GPU-only phases are listed with their commands)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(tmp_path: Path, phases: str) -> dict:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--dry-run", "--out", str(out), "--phases", phases],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_script_parses_and_lists_its_wheels() -> None:
    subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=ROOT, check=True)
    reqs = [
        line.split(">")[0]
        for line in (ROOT / "benchmarks/gpu_wheels.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert "msgspec" in reqs and "pytest" in reqs


def test_dry_run_report(tmp_path: Path) -> None:
    report = _dry_run(
        tmp_path, "kernel_tests,decode_table,shared_system,decode_bandwidth,model_runner"
    )
    phases = report["phases"]
    assert report["dry_run"] and all(p["ok"] for p in phases.values()), phases
    assert "tests/kernels" in phases["kernel_tests"]["command"]
    assert "bench_kernels_gpu.py" in phases["decode_bandwidth"]["command"]
    rows = phases["decode_table"]["rows"]
    assert {(r["batch"], r["context"]) for r in rows} == {(1, 64), (4, 64), (1, 128), (4, 128)}
    assert all(r["eager_tok_s"] > 0 for r in rows)
    shared = phases["shared_system"]
    assert shared["cache_on"]["hit_rate"] > 0 == shared["cache_off"]["hit_rate"]
    assert shared["cache_on"]["computed_tokens"] < shared["cache_off"]["computed_tokens"]


@pytest.mark.slow
def test_dry_run_greedy_phase(tmp_path: Path) -> None:
    phase = _dry_run(tmp_path, "greedy_vs_hf")["phases"]["greedy_vs_hf"]
    assert phase["ok"] and all(
        phase[f"{m}/float32"]["identical"] for m in ("tiny_llama", "tiny_qwen2", "tiny_mqa")
    )
