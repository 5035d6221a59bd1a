"""``bench_moe.py``'s pair of models: the dense one reads as many weights per token as the
MoE one (the same attention, embedding and head; MLP width ``top_k x`` the expert width),
the router's ``E x H`` a layer aside; and the script runs end to end on tiny shapes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import bench_modules
import pytest

from radixserve.model.config import ModelConfig

bench_moe = bench_modules.load("bench_moe.py", "bench_moe")


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_dense_model_has_the_moe_models_active_size(family: str) -> None:
    sys_argv, sys.argv = sys.argv, ["bench_moe.py", "--family", family]
    try:
        args = bench_moe.parse_args()
    finally:
        sys.argv = sys_argv
    moe_raw, dense_raw = bench_moe.shapes(args)
    base = {"max_position_embeddings": 2048, "tie_word_embeddings": False}
    moe = ModelConfig.from_dict({**base, **moe_raw, "model_type": family})
    dense = ModelConfig.from_dict({**base, **dense_raw, "model_type": bench_moe.DENSE_OF[family]})
    assert moe.moe is not None and moe.moe.num_experts == args.experts
    router = args.layers * args.experts * args.hidden
    assert moe.num_active_params - router == dense.num_params
    assert moe.num_params > 2 * dense.num_params  # every expert held: far more in all


def test_smoke_run_writes_its_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "moe.json"
    monkeypatch.setattr(
        sys, "argv", ["bench_moe.py", "--smoke", "--workdir", str(tmp_path), "--out", str(out)]
    )
    assert bench_moe.main() == 0
    result = json.loads(out.read_text())
    batch1 = result["results"][0]
    assert batch1["batch"] == 1 and batch1["moe"]["experts_touched_mean"] == 2.0  # top-2
    assert result["params"]["moe"]["total"] > result["params"]["dense"]["total"]
