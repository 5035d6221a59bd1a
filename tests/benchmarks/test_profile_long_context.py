"""The long-context profile's arithmetic and one run of it on a tiny model: the chunk count,
the causal FLOPs and the share of attention spent on earlier chunks are what the schedule
says, and every figure the report prints is there."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import bench_modules
import pytest

plc = bench_modules.load("profile_long_context.py", "bench_profile_long_context")


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("radixserve_cpu::paged_attention", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("radixserve_cpu::gemv_dense", "linear"),
        ("aten::addmm", "linear"),
        ("radixserve_cpu::rms_norm", "other"),
    ],
)
def test_op_classes(name: str, cls: str) -> None:
    assert plc.op_class(name) == cls


def test_a_run_reports_the_schedule(tiny_llama_dir: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "plc.json"
    argv = ["plc", "--model", str(tiny_llama_dir), "--dtype", "float32", "--lengths", "40,100"]
    argv += ["--chunk", "32", "--decode-tokens", "2", "--kv-dtypes", "auto,int8"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    assert plc.main() == 0
    report = json.loads(out.read_text())
    assert {r["kv_dtype"] for r in report["results"]} == {"auto", "int8"}
    for r in report["results"]:
        n = r["tokens"]
        assert r["chunks"] == math.ceil(n / 32) == len(r["chunk_s"])
        # Chunks of c rows after s cached: c*s + c(c+1)/2 keys each; the share beyond each
        # chunk's own rows is what re-reads the earlier chunks' KV.
        sizes = [min(32, n - s) for s in range(0, n, 32)]
        own = sum(c * (c + 1) / 2 for c in sizes)
        total = sum(c * s + c * (c + 1) / 2 for c, s in zip(sizes, range(0, n, 32), strict=True))
        assert r["attention_rereads_earlier_kv"] == pytest.approx(1 - own / total)
        assert r["step_ms"] > 0 and r["kv_floor_ms"] > 0 and r["weight_floor_ms"] > 0
        assert r["profiled_ms"]["linear"] > 0 and r["profiled_ms"]["attention"] > 0
        assert r["per_layer_profiled_ms_per_step"]["attention"] > 0
        assert r["host_ms"] > 0 and r["host_python_lines"] > 0
    # A decode step's Python work does not grow with the context (issue 44): the same lines
    # at 40 tokens as at 100, for each KV dtype.
    for kv in ("auto", "int8"):
        lines = {r["host_python_lines"] for r in report["results"] if r["kv_dtype"] == kv}
        assert len(lines) == 1, (kv, lines)
