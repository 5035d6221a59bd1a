"""The mixture-of-experts block and families beyond what ``test_families_vs_hf.py`` runs for
every family (there: ragged logits, engine greedy tokens and logprobs cold and warm, chunked
prefill, mixed batch, for ``qwen3_moe``, ``qwen2_moe``, ``mixtral`` and ``olmoe`` checkpoints):

- the block against transformers' own MoE block of each family, with a router made so that
  routing is uneven and one expert receives no row (Qwen2-MoE's with its shared expert,
  whose sigmoid gate spreads over ~0.1-0.9 and changes the output when ignored);
- the grouped path against the every-expert path (CUDA-graph capture's);
- both checkpoint layouts (per-expert tensors, transformers 5's stacked ``gate_up_proj``);
- int8/int4 experts (a shared expert's too) against their dequantized reference;
- parameter counts (total and active, a shared expert active) against transformers' models,
  and ``radixserve memory`` (with ``--tp 2`` too).

Tolerance (float32): block outputs and logits within 1e-5 + 1e-4 relative (measured ~2e-6).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tiny_models
import torch
from safetensors.torch import save_file

from radixserve.cli import main
from radixserve.model.attention.dense import DenseAttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.families.moe import MoEConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.layers.moe import SparseMoeBlock
from radixserve.model.loader import load_model
from radixserve.model.quant import set_reference_mode

HIDDEN, EXPERTS = 64, 8

# family -> (transformers config overrides, its MoE block class name, norm_topk_prob)
_BLOCKS: dict[str, tuple[dict[str, Any], str, bool]] = {
    "qwen3_moe": (
        {"num_experts": EXPERTS, "moe_intermediate_size": 32, "norm_topk_prob": True},
        "Qwen3MoeSparseMoeBlock",
        True,
    ),
    "qwen2_moe": (
        {
            "num_experts": EXPERTS,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
        },
        "Qwen2MoeSparseMoeBlock",
        False,
    ),
    "mixtral": (
        {"num_local_experts": EXPERTS, "intermediate_size": 32},
        "MixtralSparseMoeBlock",
        True,
    ),
    "olmoe": ({"num_experts": EXPERTS, "intermediate_size": 32}, "OlmoeSparseMoeBlock", False),
}


def _hf_block(model_type: str, top_k: int) -> torch.nn.Module:
    import transformers
    from transformers import AutoConfig

    overrides, cls, _ = _BLOCKS[model_type]
    cfg = AutoConfig.for_model(
        model_type, hidden_size=HIDDEN, num_experts_per_tok=top_k, **overrides
    )
    module = getattr(transformers.models, model_type)
    torch.manual_seed(0)
    block = getattr(getattr(module, f"modeling_{model_type}"), cls)(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
        # Uneven: every row's lane 0 is positive (``_rows``); expert 0 reads it strongly
        # positive (it takes every row), expert 5 strongly negative (it takes none), the
        # others route by the remaining random lanes.
        block.gate.weight[:, 0] = 0.0
        block.gate.weight[0, 0] = 20.0
        block.gate.weight[5, 0] = -20.0
    return block


def _ours(block: torch.nn.Module, model_type: str, top_k: int) -> SparseMoeBlock:
    _, _, norm = _BLOCKS[model_type]
    width = block.experts.down_proj.shape[-1]
    shared = getattr(block, "shared_expert", None)
    moe = MoEConfig(
        EXPERTS,
        top_k,
        width,
        norm,
        shared_expert_size=0 if shared is None else shared.down_proj.in_features,
        shared_expert_gate=shared is not None,
    )
    ours = SparseMoeBlock(HIDDEN, moe, bias=False)
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        for e, mlp in enumerate(ours.experts):
            mlp.gate_up_proj.weight.copy_(block.experts.gate_up_proj[e])
            mlp.down_proj.weight.copy_(block.experts.down_proj[e])
        if shared is not None:
            assert ours.shared_expert is not None and ours.shared_expert_gate is not None
            gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
            ours.shared_expert.gate_up_proj.weight.copy_(gate_up)
            ours.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
    return ours


@pytest.mark.parametrize("model_type", sorted(_BLOCKS))
@pytest.mark.parametrize("top_k", [2, 3])
def test_block_matches_transformers_with_uneven_routing(model_type: str, top_k: int) -> None:
    hf = _hf_block(model_type, top_k)
    ours = _ours(hf, model_type, top_k)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    x[:, 0] = x[:, 0].abs() + 0.5
    counts = ours.expert_counts(x).tolist()
    assert counts[0] == 37 and counts[5] == 0  # one expert on every row, one on none
    assert sum(counts) == 37 * top_k and len(set(counts)) > 2  # uneven over the others
    with torch.no_grad():
        want = hf(x[None])[0]
        got = ours(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        # The CUDA-graph path (every expert, zero weights off-route) gives the same rows.
        weights, ids = ours.gate(x)
        every = ours._add_shared(x, ours._forward_every_expert(x, weights, ids))
        torch.testing.assert_close(every, want, atol=1e-5, rtol=1e-4)
        if ours.shared_expert_gate is not None:  # Qwen2-MoE: the shared expert's gate bites
            assert ours.shared_expert is not None
            gates = ours.shared_expert_gate(x)
            assert gates.min() < 0.3 and gates.max() > 0.7
            ungated = ours._routed(x) + ours.shared_expert(x)
            assert (ungated - want).abs().max() > 0.1
        # One row (a decode step of one sequence): top_k experts run, the others are skipped.
        torch.testing.assert_close(ours(x[3:4]), hf(x[None, 3:4])[0], atol=1e-5, rtol=1e-4)


def _build(tmp: Path, model_type: str, **overrides: Any) -> Path:
    return tiny_models.build_tiny_family(tmp, model_type, **overrides)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(
        tmp_path_factory.mktemp("qwen3_moe"),
        "qwen3_moe",
        num_hidden_layers=3,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    )


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe", **tiny_models.QWEN2_MOE)


def _logits(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    return model(ForwardBatch.for_full_sequences(seqs, all_logits=True), DenseAttentionBackend())


_SEQS = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(20, 43))]


def test_stacked_checkpoint_layout_loads(qwen3_moe_dir: Path, tmp_path: Path) -> None:
    """transformers 5 holds experts stacked (``experts.gate_up_proj [E, 2I, H]``); a checkpoint
    saved in that layout loads into the same model as the per-expert one."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_moe_dir), dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((qwen3_moe_dir / "config.json").read_text())
    per_expert, stacked = load_model(qwen3_moe_dir), load_model(tmp_path)
    assert [type(layer.mlp).__name__ for layer in stacked.model.layers] == [
        "SparseMoeBlock",
        "GatedMLP",  # mlp_only_layers=[1]
        "SparseMoeBlock",
    ]
    torch.testing.assert_close(_logits(stacked, _SEQS), _logits(per_expert, _SEQS), atol=0, rtol=0)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_quantized_experts_match_dequantized_reference(
    family: str, method: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(f"{family}_dir")
    full = load_model(path)
    model = load_model(path, quantization=method, announce=False)
    report = model.quant_report
    assert report is not None
    expert_layers = [n for n in report.layers if ".experts." in n]
    # 2 sparse layers x 8 experts x (gate_up, down); the router stays in full precision.
    assert len(expert_layers) == 2 * EXPERTS * 2
    assert not any(n.endswith(".gate") for n in report.layers)
    # Qwen2-MoE's shared expert is quantized like the routed ones, its gate is not.
    shared = [n for n in report.layers if ".shared_expert." in n]
    assert len(shared) == (2 * 2 if family == "qwen2_moe" else 0)
    assert not any("shared_expert_gate" in n for n in report.layers)
    got = _logits(model, _SEQS)
    set_reference_mode(model, True)
    ref = _logits(model, _SEQS)
    scale = ref.abs().max().item()
    assert scale > 1.0
    # The kernels against dequantize-then-matmul: bf16 compute rounding (~1 % of the scale).
    torch.testing.assert_close(got, ref, atol=2e-2 * scale, rtol=0)
    # And the quantization error itself, against the float32 model: small on average (a row
    # whose routing flips under quantization differs more; measured mean 0.5 % / 4.7 % of the
    # logits' scale for int8 / int4 on these random weights).
    mean_err = (ref - _logits(full, _SEQS)).abs().mean().item()
    print(f"{family} {method}: mean error {mean_err / scale:.2%} of the logits' scale")
    assert mean_err < {"int8": 0.01, "int4": 0.1}[method] * scale


def _hf_param_count(path: Path) -> int:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return sum(p.numel() for p in hf.parameters())


def test_param_counts_total_and_active(qwen3_moe_dir: Path, tmp_path: Path) -> None:
    cfg = ModelConfig.from_pretrained(qwen3_moe_dir)
    assert cfg.moe is not None and cfg.moe.dense_layers == (1,)
    assert cfg.num_params == _hf_param_count(qwen3_moe_dir)
    # Active: 2 of 8 experts in each of the 2 sparse layers.
    expert = 3 * 64 * 32
    assert cfg.num_params - cfg.num_active_params == 2 * (EXPERTS - 2) * expert
    for model_type, extra in (
        ("qwen2_moe", {**tiny_models.QWEN2_MOE, "num_experts": 4}),
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    ):
        path = _build(tmp_path / model_type, model_type, **extra)
        assert ModelConfig.from_pretrained(path).num_params == _hf_param_count(path)


def test_qwen2_moe_shared_expert_is_active(qwen2_moe_dir: Path) -> None:
    """Qwen2-MoE: every token reads its shared expert (and the gate): active parameters are
    the total less the routed experts a token skips, nothing of the shared expert's."""
    cfg = ModelConfig.from_pretrained(qwen2_moe_dir)
    moe = cfg.moe
    assert moe is not None and moe.dense_layers == (1,) and not moe.norm_topk_prob
    assert (moe.shared_expert_size, moe.shared_expert_gate) == (96, True)
    assert cfg.attention_bias and not cfg.o_proj_bias  # qkv_bias
    assert cfg.num_params == _hf_param_count(qwen2_moe_dir)
    skipped = 2 * (EXPERTS - 2) * 3 * 64 * 32  # 6 of 8 experts in each of 2 sparse layers
    assert cfg.num_params - cfg.num_active_params == skipped
    shared = 2 * (3 * 64 * 96 + 64)  # gate_up, down and the gate, in 2 sparse layers
    assert shared < cfg.num_active_params
    # num_experts 0: every layer dense, as transformers builds it.
    raw = json.loads((qwen2_moe_dir / "config.json").read_text())
    assert ModelConfig.from_dict({**raw, "num_experts": 0}).moe is None


def test_sparse_step_and_mlp_only_layers() -> None:
    raw = {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 6,
        "vocab_size": 100,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    moe = ModelConfig.from_dict(raw).moe
    assert moe is not None
    # transformers: sparse iff not mlp-only and (i + 1) % step == 0.
    assert [moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**raw, "num_experts_per_tok": 5})


def test_memory_reports_total_and_active(
    qwen3_moe_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = ModelConfig.from_pretrained(qwen3_moe_dir)
    argv = ["memory", "--model", str(qwen3_moe_dir), "--memory-budget", "1GiB"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_params"] == cfg.num_params
    assert data["num_active_params"] == cfg.num_active_params < cfg.num_params
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"{cfg.num_active_params:,} active per token" in out
    assert "8 experts, 2 per token" in out


def test_memory_reports_the_shared_expert(
    qwen2_moe_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = ModelConfig.from_pretrained(qwen2_moe_dir)
    argv = ["memory", "--model", str(qwen2_moe_dir), "--memory-budget", "1GiB"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_active_params"] == cfg.num_active_params
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "a shared expert of width 96 (gated) on every token" in out
    assert f"{cfg.num_active_params:,} active per token" in out


def test_tp2_weight_bytes_are_rank_zeros_shard(
    qwen3_moe_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``--tp 2`` every expert is cut on its MLP width (the router whole on each rank):
    the planner's per-device weight bytes are rank 0's shard as built (on ``meta``), up to the
    per-layer mean's rounding, and ``radixserve memory --tp 2`` says how the experts are held.
    (tests/distributed/test_tp_families.py runs the shards.)"""
    from radixserve.memory.footprint import weight_bytes
    from radixserve.memory.sharding import DeviceShard
    from radixserve.model.llama import LlamaForCausalLM
    from radixserve.model.parallel import TPGroup

    cfg = ModelConfig.from_pretrained(qwen3_moe_dir)
    with torch.device("meta"):
        rank0 = LlamaForCausalLM(cfg, TPGroup(None, 0, 2, torch.device("cpu")))
    held = sum(p.numel() for p in rank0.parameters()) * 4
    planned = weight_bytes(cfg, torch.float32, shard=DeviceShard(tp_size=2))
    assert abs(planned - held) <= 3 and planned < 0.6 * weight_bytes(cfg, torch.float32)
    argv = ["memory", "--model", str(qwen3_moe_dir), "--memory-budget", "1GiB", "--tp", "2"]
    assert main(argv) == 0
    assert "experts: all 8 on every rank, each cut on its MLP width: 16 of 32 rows" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("method", [None, "int8", "int4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_planner_weight_bytes_hold_every_expert(
    family: str, method: str | None, request: pytest.FixtureRequest
) -> None:
    """The memory planner's weight bytes for a MoE model (experts and a shared expert
    quantized, the router and the shared expert's gate not) equal the loaded model's
    parameters and quantized buffers, up to the per-layer mean's rounding."""
    from radixserve.memory.footprint import weight_bytes
    from radixserve.model.quant.linear import QuantizedLinear

    path: Path = request.getfixturevalue(f"{family}_dir")
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, quantization=method, announce=False, pack_linears=False)
    held = sum(t.numel() * t.element_size() for t in model.parameters())
    held += sum(
        b.numel() * b.element_size()
        for m in model.modules()
        if isinstance(m, QuantizedLinear)
        for b in m.buffers()
    )
    assert abs(weight_bytes(cfg, torch.float32, method) - held) <= 3
