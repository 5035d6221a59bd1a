"""benchmarks/gpu_check.sh: its phase plan, budget and report, run on the CPU in dry-run mode
(tiny shapes, torch backend; the GPU-only phases are listed with their commands), and its
refusal to start without the wheel folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_wheels  # noqa: E402


def _dry_run(tmp_path: Path, *args: str, out: Path | None = None) -> dict[str, Any]:
    out = out or tmp_path / "gpu_check.json"
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--dry-run", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    report["stdout"] = proc.stdout
    return report


def test_wheels_cover_every_dependency_beyond_the_image() -> None:
    subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=ROOT, check=True)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    have = {gpu_wheels.project_name(r) for r in gpu_wheels.requirements()}
    image = {gpu_wheels.project_name(r) for r in gpu_wheels.requirements(gpu_wheels.IMAGE)}
    missing = {gpu_wheels.project_name(d) for d in deps} - have - image
    assert not missing, f"pyproject dependencies neither in the image nor in the wheels: {missing}"
    assert {"pytest", "hypothesis", "pytest-timeout"} <= have  # the check runs the tests
    assert have.isdisjoint(image)


def test_no_wheel_folder_stops_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--part", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": sys.executable, "WHEELS": str(tmp_path / "none")},
    )
    assert proc.returncode == 3 and not proc.stdout
    assert len(proc.stderr.splitlines()) == 1 and "--download-wheels" in proc.stderr


def test_budget_skips_what_does_not_fit_and_out_accumulates(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    # kernel_tests fits (a dry run lists it), decode_table's estimate does not: skipped, said so.
    first = _dry_run(tmp_path, "--phases", "kernel_tests,decode_table", "--budget-s", "10", out=out)
    phases = first["phases"]
    assert phases["kernel_tests"]["skipped"] == "needs a GPU"
    assert "tests/kernels" in phases["kernel_tests"]["commands"][0]
    assert phases["decode_table"]["skipped"].startswith("budget: estimated 15 s")
    assert re.search(r"decode_table: skipped in .* \(estimated 15 s\): budget", first["stdout"])
    assert all(p["ok"] and "elapsed_s" in p and "estimated_s" in p for p in phases.values())
    # A second run (part 2's GPU-only phases) adds to the same report.
    second = _dry_run(tmp_path, "--phases", "quant_linear", out=out)
    assert set(second["phases"]) == {"kernel_tests", "decode_table", "quant_linear"}
    assert [r["phases"] for r in second["runs"]] == [
        ["kernel_tests", "decode_table"],
        ["quant_linear"],
    ]
    assert "gpu_int8_paths.py" in second["phases"]["quant_linear"]["commands"][1]


def test_parts_split_the_phases() -> None:
    import gpu_check

    one = [p.name for p in gpu_check.select("1", None)]
    two = [p.name for p in gpu_check.select("2", None)]
    assert one == ["decode_bandwidth", "greedy_vs_hf", "default_model"]
    assert [p.name for p in gpu_check.select("3", None)] == ["kernel_tests"]
    assert two == ["decode_table", "shared_system", "serve_http", "quant_linear", "model_runner"]
    for part in ("1", "2", "3"):  # each part's estimates fit the default budget
        assert sum(p.estimate_s for p in gpu_check.select(part, None)) <= gpu_check.DEFAULT_BUDGET_S


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One dry run of the phases that run on the CPU (one start-up of the driver, not one per
    test): the decode table, the shared-system and greedy phases, and serve_http (a real
    server, chats over HTTP) and model_runner (bench_runner_step.py on the SmolLM2-shaped
    checkpoint passed as --model: nothing fetched)."""
    phases = "decode_table,shared_system,greedy_vs_hf,serve_http,model_runner"
    tmp = tmp_path_factory.mktemp("gpu_check")
    return _dry_run(tmp, "--phases", phases, "--budget-s", "900")["phases"]


@pytest.mark.slow  # the dry run starts a real server
def test_dry_run_report(dry_run: dict[str, Any]) -> None:
    phases = dry_run
    assert all(p["ok"] for p in phases.values()), phases
    rows = phases["decode_table"]["rows"]
    assert {(r["batch"], r["context"]) for r in rows} == {(1, 64), (4, 64), (1, 128), (4, 128)}
    assert all(r["eager_tok_s"] > 0 for r in rows)
    shared = phases["shared_system"]
    assert shared["cache_on"]["hit_rate"] > 0 == shared["cache_off"]["hit_rate"]
    assert shared["cache_on"]["computed_tokens"] < shared["cache_off"]["computed_tokens"]


@pytest.mark.slow
def test_dry_run_greedy_phase(dry_run: dict[str, Any]) -> None:
    phase = dry_run["greedy_vs_hf"]
    assert phase["ok"] and all(
        phase[f"{m}/float32"]["identical"] for m in ("tiny_llama", "tiny_qwen2", "tiny_mqa")
    )


@pytest.mark.slow
def test_dry_run_server_and_runner_phases(dry_run: dict[str, Any]) -> None:
    serve = dry_run["serve_http"]
    assert serve["ok"] and serve["server_exit"] == 0 and serve["output_tok_s"] > 0, serve
    runner = dry_run["model_runner"]
    assert runner["ok"], runner
    assert runner["bench"]["device"] == "cpu" and runner["bench"]["results"]
    assert runner["test"]["skipped"] == "needs a GPU"
