"""Expert parallelism (``--expert-parallel``): each of two gloo ranks holds ``num_experts / 2``
whole experts, routes every row with the whole router, computes its own experts' slots, and
one all-reduce sums the two halves; attention stays tensor-parallel as without it.

The model-level checks share ``test_tp_families.py``'s spawn of two ranks (Mixtral,
Qwen3-MoE, OLMoE under expert parallelism against one rank; expert blocks with an expert,
and a whole rank, receiving no row). Here:

- the engine at TP 2 with ``expert_parallel=True`` (the flag through the rank settings and
  the ranks' loader, paged attention, chunked prefill) against one process.
- Without ranks: what each rank holds and reads (only its own experts' tensors, renamed to
  its local index), the planner's weight bytes, and the refusals (``num_experts % tp``,
  pipeline parallelism).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tiny_models
import torch

from radixserve.cli import build_parser
from radixserve.commands.engine_args import engine_config
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.model.config import ModelConfig
from radixserve.model.families.moe import MoEConfig
from radixserve.model.loader import iter_safetensors
from radixserve.model.parallel import (
    TPGroup,
    checkpoint_slice,
    local_tensor_name,
    shard_for_rank,
)
from radixserve.sampling_params import SamplingParams

LOGPROB_ATOL = 1e-4
NEW_TOKENS = 5

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": (
        "mixtral",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48},
    ),
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 25,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
}


def _seqs(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, tiny_models.TOKENIZER_VOCAB, (n,), generator=g).tolist() for n in lengths
    ]


@pytest.fixture(scope="module")
def case_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: tiny_models.build_tiny_family(
            tmp_path_factory.mktemp(name), model_type, tokenizer=name == "qwen3_moe", **extra
        )
        for name, (model_type, extra) in CASES.items()
    }


def test_engine_ep2_equals_one_process(case_dirs: dict[str, Path]) -> None:
    """The serving path with ``expert_parallel=True`` at TP 2 (paged CPU attention, prefill
    in chunks of 16, mixed lengths): one process's greedy tokens and logprobs."""
    path = case_dirs["qwen3_moe"]
    prompts = _seqs((21, 3, 12), 2)
    config = {"page_size": 4, "num_pages": 64, "max_num_tokens": 16}
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)

    def run(engine: Engine) -> list[tuple[list[int], list[float]]]:
        outs = engine.generate(prompts, params)
        engine.check_invariants()
        return [(o.token_ids, [lp.logprob for lp in o.logprobs or []]) for o in outs]

    single = Engine(str(path), **config)  # type: ignore[arg-type]
    try:
        want = run(single)
    finally:
        single.close()
    engine = Engine(
        str(path),
        tensor_parallel_size=2,
        expert_parallel=True,
        dist_timeout=30.0,
        **config,  # type: ignore[arg-type]
    )
    try:
        assert engine.model.local_config.moe is not None
        assert engine.model.local_config.moe.expert_range == (0, 4)
        for (ids, lps), (want_ids, want_lps) in zip(run(engine), want, strict=True):
            assert ids == want_ids
            assert lps == pytest.approx(want_lps, abs=LOGPROB_ATOL)
    finally:
        engine.close()
    for proc in engine.topology.ranks.procs.values():  # type: ignore[attr-defined]
        assert not proc.is_alive()


# -- without ranks ---------------------------------------------------------------------------


def _moe_config(experts: int = 8) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "model_type": "mixtral",
            "hidden_size": 64,
            "intermediate_size": 48,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_hidden_layers": 2,
            "vocab_size": 512,
            "num_local_experts": experts,
            "num_experts_per_tok": 2,
        }
    )


def test_each_rank_holds_whole_experts_and_odd_counts_are_refused() -> None:
    cfg = _moe_config()
    shards = [shard_for_rank(cfg, r, 2, expert_parallel=True) for r in range(2)]
    assert [s.experts for s in shards] == [(0, 4), (4, 8)]
    assert shards[1].expert_intermediate == (0, 48)  # whole experts: no width cut
    assert shards[1].local_config(cfg).moe == MoEConfig(8, 2, 48, True, expert_range=(4, 8))
    assert shard_for_rank(cfg, 1, 2).experts is None  # the default: every expert cut
    with pytest.raises(ValueError, match=r"6 experts.*4 tensor-parallel ranks.*num_experts % tp"):
        shard_for_rank(_moe_config(6), 0, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="expert parallelism is not supported with pipeline"):
        EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2, expert_parallel=True)
    args = build_parser().parse_args(["serve", "--tp", "2", "--enable-expert-parallel"])
    assert engine_config(args)["expert_parallel"] is True
    assert "expert_parallel" not in engine_config(build_parser().parse_args(["generate", "hi"]))


def test_checkpoint_names_and_slices_under_expert_parallelism() -> None:
    """Rank 1 of 2 (experts 4-7): another rank's expert is dropped before any read; its own
    are renamed to local indices and read whole; stacked experts are read on their rows 4-7."""
    two = shard_for_rank(_moe_config(), 1, 2, expert_parallel=True)
    layer = "model.layers.0."
    assert local_tensor_name(layer + "mlp.experts.2.gate_proj.weight", two) is None
    assert (
        local_tensor_name(layer + "block_sparse_moe.experts.6.w2.weight", two)
        == layer + "block_sparse_moe.experts.2.w2.weight"
    )
    assert local_tensor_name(layer + "mlp.gate.weight", two) == layer + "mlp.gate.weight"
    assert checkpoint_slice(layer + "mlp.experts.6.down_proj.weight", two, 16) is None
    for stacked in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        cut = checkpoint_slice(layer + stacked, two, 16)
        assert cut is not None and (cut.dim, cut.ranges) == (0, ((4, 8),))


def test_loader_reads_only_its_own_experts(case_dirs: dict[str, Path]) -> None:
    """``iter_safetensors`` for rank 1 of the Mixtral checkpoint yields experts 4-7 only (as
    0-3, whole), every other tensor as the width-cut TP shard reads it; the rank's model
    built from them counts, and the planner sizes, exactly what it holds."""
    from safetensors import safe_open

    path = case_dirs["mixtral"]
    cfg = ModelConfig.from_pretrained(path)
    shard = shard_for_rank(cfg, 1, 2, expert_parallel=True)
    got = dict(iter_safetensors(path, shard, cfg.head_dim))
    experts = {n for n in got if ".experts." in n}
    assert experts == {
        f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"
        for i in range(2)
        for e in range(4)
        for w in ("w1", "w2", "w3")
    }
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        want = f.get_tensor("model.layers.1.block_sparse_moe.experts.5.w2.weight")
    assert torch.equal(got["model.layers.1.block_sparse_moe.experts.1.w2.weight"], want)

    from radixserve.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        rank1 = LlamaForCausalLM(
            cfg, TPGroup(None, 1, 2, torch.device("cpu")), expert_parallel=True
        )
    held = dict(rank1.named_parameters())
    assert sum(p.numel() for n, p in held.items() if ".experts." in n) == 2 * 4 * 3 * 64 * 48
    assert rank1.local_config.num_params == sum(p.numel() for p in held.values())


def test_shared_expert_is_cut_on_its_width_under_expert_parallelism() -> None:
    """Qwen2-MoE under ``--expert-parallel``: each rank holds 4 whole routed experts and its
    rows of the shared expert (width 37: 19 + 18), the gate whole; the planner's per-device
    weight bytes are rank 0's shard as built. (test_tp_families.py runs the ranks.)"""
    from radixserve.memory.footprint import weight_bytes
    from radixserve.memory.sharding import DeviceShard
    from radixserve.model.llama import LlamaForCausalLM

    cfg = ModelConfig.from_dict(
        {
            "model_type": "qwen2_moe",
            "hidden_size": 64,
            "intermediate_size": 48,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 37,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "vocab_size": 512,
            "num_experts": 8,
            "num_experts_per_tok": 2,
        }
    )
    for rank, rows in ((0, 19), (1, 18)):
        with torch.device("meta"):
            model = LlamaForCausalLM(
                cfg, TPGroup(None, rank, 2, torch.device("cpu")), expert_parallel=True
            )
        held = dict(model.named_parameters())
        assert held["model.layers.0.mlp.shared_expert.down_proj.weight"].shape == (64, rows)
        assert held["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
        assert sum(p.numel() for n, p in held.items() if ".experts." in n) == 2 * 4 * 3 * 64 * 32
        assert model.local_config.num_params == sum(p.numel() for p in held.values())
        if rank == 0:
            shard = DeviceShard(tp_size=2, expert_parallel=True)
            assert weight_bytes(cfg, torch.float32, shard=shard) == 4 * sum(
                p.numel() for p in held.values()
            )


def test_memory_plan_sizes_whole_experts_per_rank(
    case_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``radixserve memory --tp 2 --expert-parallel``: the planner's per-device weight bytes are
    rank 0's expert-parallel shard as built (4 whole experts of 8), and the report says so;
    an expert count the ranks do not divide is refused there too."""
    from radixserve.cli import main
    from radixserve.memory.footprint import weight_bytes
    from radixserve.memory.sharding import DeviceShard
    from radixserve.model.llama import LlamaForCausalLM

    path = case_dirs["mixtral"]
    cfg = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        rank0 = LlamaForCausalLM(
            cfg, TPGroup(None, 0, 2, torch.device("cpu")), expert_parallel=True
        )
    held = sum(p.numel() for p in rank0.parameters()) * 4
    assert (
        weight_bytes(cfg, torch.float32, shard=DeviceShard(tp_size=2, expert_parallel=True)) == held
    )
    # The command on a config alone (expert width 64: its int4 lines need a group dividing it).
    wide = tmp_path / "wide"
    wide.mkdir()
    raw = json.loads((path / "config.json").read_text()) | {"intermediate_size": 64}
    (wide / "config.json").write_text(json.dumps(raw))
    argv = ["memory", "--model", str(wide), "--memory-budget", "1GiB", "--tp", "2"]
    assert main([*argv, "--expert-parallel"]) == 0
    assert "experts (expert parallel): 4 of 8 whole experts per rank, width 64" in (
        capsys.readouterr().out
    )
    assert main(["memory", "--model", str(wide), "--tp", "3", "--expert-parallel"]) == 1
    assert "num_experts % tp" in capsys.readouterr().err
