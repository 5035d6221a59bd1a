"""Each tensor-parallel rank's share of a LoRA adapter (``radixserve/model/lora/tp.py``),
read from PEFT's files for the rank's shard of the model: on a column-parallel layer the
ranks' deltas are the whole adapter's delta on their output columns; on a row-parallel
layer the ranks' partial deltas (each over its input columns) sum to the whole delta (the
layer's all-reduce sums them). Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` as adapted
layers, uneven heads (9 over 3 KV heads: 6 + 3) and a KV head replicated on both ranks.

The shards are loaded as the ranks load them, with a rank group that has no backend: reading
an adapter runs no collective (``tests/distributed/test_tp_lora.py`` runs real ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import tiny_models
import torch
from torch import nn

from radixserve.model.config import ModelConfig
from radixserve.model.loader import load_model
from radixserve.model.lora import read_adapter
from radixserve.model.parallel import TPGroup, checkpoint_slice, shard_for_rank

CPU = torch.device("cpu")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = {
    "phi3_fused": ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "q9_kv3": ("q9_kv3", ALL),
    "kv1_replicated": ("kv1", ALL),
}


def _model_dir(kind: str, root: Path) -> Path:
    if kind == "phi3":
        return tiny_models.build_tiny_family(root, "phi3")
    if kind == "q9_kv3":
        return tiny_models.build_tiny_llama(
            root, num_q_heads=9, num_kv_heads=3, hidden_size=144, intermediate_size=75
        )
    return tiny_models.build_tiny_llama(root, num_kv_heads=1)


def _cols(module: str, cfg: ModelConfig, rank: int) -> tuple[int, list[int]]:
    """(the dim a rank's share of ``module`` is cut on, its global indices there, in the
    order of its local layer): the fused weight's own cut."""
    cut = checkpoint_slice(f"{module}.weight", shard_for_rank(cfg, rank, 2), cfg.head_dim)
    assert cut is not None
    return cut.dim, [i for lo, hi in cut.ranges for i in range(lo, hi)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_rank_shares_make_the_whole_delta(case: str, tmp_path: Path) -> None:
    kind, targets = CASES[case]
    path = _model_dir(kind, tmp_path / "model")
    adapter_dir = tiny_models.build_lora_adapter(path, tmp_path / "lora", targets=targets)
    args: dict[str, Any] = {"dtype": torch.float32, "device": CPU, "announce": False}
    whole_model = load_model(path, **args)
    whole = read_adapter("a", adapter_dir, whole_model, max_rank=64)
    shares = [
        read_adapter("a", adapter_dir, load_model(path, **args, tp=TPGroup(None, r, 2, CPU)), 64)
        for r in range(2)
    ]
    cfg = whole_model.config
    torch.manual_seed(0)
    for module, delta in whole.deltas.items():
        layer = cast("nn.Linear", whole_model.get_submodule(module))
        x = torch.randn(5, layer.in_features)
        want = torch.zeros(5, layer.out_features)
        delta.apply(x, want, None)
        summed = torch.zeros_like(want)
        for rank, share in enumerate(shares):
            dim, idx = _cols(module, cfg, rank)
            part = share.deltas[module]
            if dim == 0:  # column-parallel: the rank's output columns of the whole delta
                got = torch.zeros(5, len(idx))
                part.apply(x, got, None)
                torch.testing.assert_close(got, want[:, idx], rtol=1e-5, atol=1e-5)
            else:  # row-parallel: a partial delta over the rank's input columns
                part.apply(x[:, idx].contiguous(), summed, None)
        if dim == 1:
            torch.testing.assert_close(summed, want, rtol=1e-5, atol=1e-5)
