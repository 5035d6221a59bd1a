"""benchmarks/bench_speculative.py: seeded workloads of the right shape, and a tiny run
through two real HTTP servers (tiny Llama: no speculation, and ngram) that reports usage's
drafted/accepted counts (slow: two server processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_modules import load

bench = load("bench_speculative.py", "bench_speculative")


def test_workloads_are_seeded_and_copy_heavy_where_they_say() -> None:
    a, b = bench.build(3, seed=1), bench.build(3, seed=1)
    assert a == b and a != bench.build(3, seed=2)
    doc = a["copy"][0]["prompt"]
    assert "Quote the document" in doc and all(r["temperature"] == 0.0 for r in a["copy"])
    assert all("Repeat your first answer" in r["prompt"] for r in a["chat"])
    assert all(r["temperature"] == 0.8 for r in a["nocopy"])


def test_draft_config_makes_a_truncated_draft(tiny_llama_dir: Path, tmp_path: Path) -> None:
    args = bench.parse(["--model", str(tiny_llama_dir), "--configs", "off,draft"])
    flags = bench.draft_flags(args, tmp_path)
    assert flags[:3] == ["--speculative-algorithm", "draft", "--speculative-draft-model"]
    config = json.loads((Path(flags[3]) / "config.json").read_text())
    assert config["num_hidden_layers"] == 1  # a fifth of 2 layers, at least one


@pytest.mark.slow
def test_tiny_run_through_http(tiny_llama_dir: Path) -> None:
    args = bench.parse(
        [
            "--model",
            str(tiny_llama_dir),
            "--configs",
            "off,ngram",
            "--per-workload",
            "1",
            "--max-tokens",
            "12",
            "--threads",
            "1",
            "--dtype",
            "float32",
            "--concurrency",
            "2",
            "--concurrent-requests",
            "2",
            "--concurrent-rounds",
            "1",
            "--out",
            "",
        ]
    )
    run = bench.run(args)
    out = run["results"]
    assert set(out) == {"off", "ngram"}
    assert len(run["requests"]) == 2 * 4  # every request's record: 2 configs x 4 workloads
    assert [r["config"] for r in run["concurrent"]["rounds"]] == ["off", "ngram"]
    assert all(r["tokens"] > 0 for r in run["concurrent"]["rounds"])
    assert run["floor"]["before"]["floor_ms"] > 0
    for per in out.values():
        assert set(per) == {"copy", "chat", "fork", "nocopy"}
        assert all(row["tokens"] > 0 for row in per.values())
        assert all(row["decode_tokens_per_s"] > row["tokens_per_s"] > 0 for row in per.values())
    for rec in run["requests"]:  # streamed: the first token, then the decode
        assert 0 < rec["ttft_s"] < rec["seconds"]
        assert rec["decode_s"] == pytest.approx(rec["seconds"] - rec["ttft_s"])
    assert out["off"]["copy"]["drafted"] == 0
    nocopy = out["ngram"]["nocopy"]  # sampled: rejection sampling where drafts exist
    assert nocopy["accepted"] <= nocopy["drafted"]
