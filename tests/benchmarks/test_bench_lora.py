"""benchmarks/bench_lora.py runs end to end on the tiny Llama and writes its JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_lora  # noqa: E402


def test_tiny_run(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    argv = ["--model", str(tiny_llama_dir), "--batch", "1,3", "--adapters", "2", "--rank", "4"]
    assert bench_lora.main([*argv, "--decode-tokens", "4", "--rounds", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "bench_lora" and len(result["rounds"]) == 2
    assert set(result["rounds"][0]["3"]) == {"base", "one_adapter", "mixed"}
    assert all(rate > 0 for r in result["rounds"] for b in r.values() for rate in b.values())
